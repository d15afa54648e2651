"""The attention layers' keys and values as one pool of fixed-size pages shared by the lanes, and the block table
that maps each lane's positions to pages.

Owns: `AttnState` (one attention layer's page storage and the table it reads through, and reading and writing a lane's
keys by position), `KVPool` (the table and its host mirror, the storage of every pooled layer, writing table entries).
The target's attention layers are pooled, and so is any backend layer that runs at the target's positions (the mtp
layer): one page then holds a position's keys in every pooled layer. Does not own: which lane holds which pages or when
they are given and taken back (ignis.engine.pages, the scheduler), or the attention math (ignis.model.attention,
ignis.kernels.attention). docs/adr/0008-paged-kv.md has the why.

Position p of lane l lives in slot p % page of page table[l, p // page]. Page 0 is the null page: never given to a
lane, it is where every unmapped table entry points (the scratch lane's whole row, and each lane's entries past the
pages it holds), so a masked read past a lane's positions and a padding row's write land in a page no lane owns. The
table has a static shape [lanes + 1, width], so the device round and the prefill pieces read it inside captured
graphs; the host changes it only between rounds (`map`), with one small upload on the current stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ignis.model.config import ModelConfig

PAGE = 64  # positions a page holds (docs/adr/0008-paged-kv.md)
NULL = 0  # the null page


@dataclass
class AttnState:
    """One attention layer's keys and values, read and written through a block table."""

    k: torch.Tensor  # [pages + 1, page, nkv, hd] model dtype, device: page 0 is the null page
    v: torch.Tensor  # [pages + 1, page, nkv, hd] model dtype, device
    table: torch.Tensor  # [lanes + 1, width] int64, device: the page of each lane's positions i*page..(i+1)*page-1

    @staticmethod
    def contiguous(k: torch.Tensor, v: torch.Tensor) -> AttnState:
        """A per-lane cache k, v [rows, slots, nkv, hd] as pages: one page of `slots` positions a row (lane l's: l)."""
        table = torch.arange(k.shape[0], dtype=torch.int64, device=k.device)[:, None]  # [rows, 1] int64
        return AttnState(k, v, table)

    @property
    def page(self) -> int:
        return self.k.shape[1]

    def slots(self, lane: int, start: int, end: int) -> torch.Tensor:
        """[end - start] int64, device: where positions start..end-1 of `lane` live, as rows of the flat storage
        [(pages + 1) * page, nkv, hd]. Device work only: no host read of the table."""
        pos = torch.arange(start, end, device=self.table.device)
        return self.table[lane].index_select(0, pos // self.page) * self.page + pos % self.page

    def write(self, lane: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n, nkv, hd] become positions start..start+n-1 of `lane`."""
        at = self.slots(lane, start, start + k.shape[0])
        _flat(self.k).index_copy_(0, at, k)
        _flat(self.v).index_copy_(0, at, v)

    def read(self, lane: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of positions 0..end-1 of `lane`: k, v [end, nkv, hd] (what a contiguous cache's k[lane, :end] was)."""
        at = self.slots(lane, 0, end)
        return _flat(self.k).index_select(0, at), _flat(self.v).index_select(0, at)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1, *t.shape[2:])  # [(pages + 1) * page, nkv, hd]: a view of the same storage


class KVPool:
    def __init__(
        self,
        config: ModelConfig,
        *,
        lanes: int,
        positions: int,
        pages: int,
        device: str | torch.device,
        dtype: torch.dtype,
        page: int = PAGE,
    ) -> None:
        """A pool of `pages` pages of `page` positions (plus the null page) for lanes 0..lanes-1 and the scratch lane
        `lanes`, each lane holding at most `positions` positions. Layers are added by `layer()`; nothing is mapped.
        pages 0: the storage is made later, by `allocate`, once every layer is known (the count depends on them)."""
        if lanes < 1 or positions < 1 or pages < 0 or page < 1:
            raise ValueError(f"KVPool needs lanes, positions, page >= 1 and pages >= 0, got {lanes}, {positions}, "
                             f"{page}, {pages}")
        self.config = config
        self.lanes = lanes
        self.page = page
        self.pages = pages
        self.width = -(-positions // page)  # table entries a lane
        self.device, self.dtype = torch.device(device), dtype
        self.table = torch.zeros((lanes + 1, self.width), dtype=torch.int64, device=device)  # [lanes + 1, width]
        self.host = np.zeros((lanes + 1, self.width), dtype=np.int64)  # the table's host mirror
        self.layers: list[AttnState] = []

    @staticmethod
    def full(config: ModelConfig, *, lanes: int, positions: int, device: str | torch.device, dtype: torch.dtype,
             page: int = PAGE) -> KVPool:
        """A pool with every lane's positions mapped once and for all (lane l: pages 1 + l * width ...): a per-lane
        cache for code that drives the model without a scheduler (tools, tests, training)."""
        width = -(-positions // page)
        pool = KVPool(config, lanes=lanes, positions=positions, pages=lanes * width, device=device, dtype=dtype,
                      page=page)
        pool.map([(lane, i, 1 + lane * width + i) for lane in range(lanes) for i in range(width)])
        return pool

    def layer(self) -> AttnState:
        """One more attention layer's keys and values, read through this pool's table (its storage is made now, or by
        `allocate` when the pool's size waits for every layer)."""
        empty = torch.empty((0, self.page, self.config.num_key_value_heads, self.config.head_dim), dtype=self.dtype,
                            device=self.device)
        state = AttnState(empty, empty, self.table)
        self.layers.append(state)
        if self.pages:
            self._make(state)
        return state

    def allocate(self, pages: int) -> None:
        """Make the storage of every layer added so far: `pages` pages (and the null page) each."""
        if self.pages:
            raise ValueError(f"the pool already holds {self.pages} pages")
        if pages < 1:
            raise ValueError(f"a pool needs at least one page, got {pages}")
        self.pages = pages
        for state in self.layers:
            self._make(state)

    def _make(self, state: AttnState) -> None:
        c = self.config
        state.k = torch.zeros((self.pages + 1, self.page, c.num_key_value_heads, c.head_dim), dtype=self.dtype,
                              device=self.device)
        state.v = torch.zeros_like(state.k)

    def page_bytes(self) -> int:
        """Bytes one page takes over the pooled layers."""
        c = self.config
        return 2 * len(self.layers) * self.page * c.num_key_value_heads * c.head_dim * torch.finfo(self.dtype).bits // 8

    def nbytes(self) -> int:
        return sum(s.k.nbytes + s.v.nbytes for s in self.layers) + self.table.nbytes

    def map(self, entries: list[tuple[int, int, int]]) -> None:
        """Write table entries (lane, index, page) in order (the last write of an entry wins); page NULL unmaps.
        Between rounds only: on a GPU one upload from pinned memory on the current stream, ordered after the work
        already queued and before what follows."""
        if not entries:
            return
        last = {(lane, index): page for lane, index, page in entries}  # one write an entry: no order to rely on
        at = np.asarray([(lane, index, page) for (lane, index), page in last.items()], dtype=np.int64).T  # [3, n]
        self.host[at[0], at[1]] = at[2]
        t = torch.from_numpy(at.copy())
        if self.table.is_cuda:
            t = t.pin_memory().to(self.table.device, non_blocking=True)
        elif self.table.device != t.device:
            t = t.to(self.table.device)
        self.table[t[0], t[1]] = t[2]

    def held(self, lane: int) -> int:
        """Pages mapped at the start of `lane`'s row (from the host mirror): its positions 0..held*page-1."""
        row = self.host[lane]
        empty = np.flatnonzero(row == NULL)
        return int(empty[0]) if empty.size else self.width

    def maps_last(self, lanes: list[int], ends: list[int]) -> np.ndarray:
        """[len(lanes)] bool: whether each lane's row (host mirror) maps the page of position ends[i] - 1, the last its
        round writes; rows fill from their first entry and give pages back from their end, so a lane that holds that
        page holds every one before it. One gather a lane, whatever the context's width."""
        last = (np.asarray(ends, dtype=np.int64) - 1) // self.page
        inside = last < self.width
        return inside & (self.host[lanes, np.minimum(last, self.width - 1)] != NULL)
