"""Paged KV cache: page bookkeeping in plain Python over integers, plus the numpy page pools.

One page holds ``page_size`` consecutive token positions of one sequence in *every* full-attention
layer (K and V), so a sequence has a single page table shared by all attention layers. Position ``p``
of a sequence lives in page ``table[p // page_size]`` at offset ``p % page_size``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .host_memory import resident_zeros


class OutOfPages(RuntimeError):
    """Not enough free pages; raised before anything was allocated, so allocator state is unchanged."""


class PageAllocator:
    """Per-sequence page tables over a pool of ``num_pages`` pages of ``page_size`` tokens.

    Pure bookkeeping: no tensors. Pages are handed out lowest index first, which keeps tests and
    logs deterministic. ``free`` of an unknown sequence raises ``KeyError``: a double free would
    hand the same page to two live sequences, which is exactly the bug it must surface.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # A stack popped from the end: reversed so that page 0 goes out first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._in_use = [False] * num_pages
        self._tables: dict[str, list[int]] = {}
        # the same tables as int64 arrays (capacity doubling), for table_view: a step of long sequences
        # would otherwise convert every list to an array each step (~50 ns per page on the host)
        self._arrays: dict[str, np.ndarray] = {}

    def pages_needed(self, num_tokens: int) -> int:
        """Pages that cover ``num_tokens`` positions (ceil division)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.page_size)

    def can_allocate(self, n: int) -> bool:
        """Whether ``n`` more pages are free."""
        return 0 <= n <= len(self._free)

    def allocate(self, seq_id: str, total_tokens: int) -> list[int]:
        """Grow ``seq_id``'s table to cover ``total_tokens`` positions; returns a copy of the table.

        Registers a new sequence on first call. Allocates only the missing pages and never shrinks.
        Raises ``OutOfPages`` without allocating anything when the pool cannot cover the growth.
        """
        table = self._tables.get(seq_id)
        have = 0 if table is None else len(table)
        missing = self.pages_needed(total_tokens) - have
        if missing > len(self._free):
            raise OutOfPages(f"sequence {seq_id!r} needs {missing} more pages for {total_tokens} tokens, "
                             f"{len(self._free)} of {self.num_pages} free")
        if table is None:
            table = self._tables[seq_id] = []
        first = len(table)
        for _ in range(max(0, missing)):
            page = self._free.pop()
            self._check_index(page)
            assert not self._in_use[page], f"page {page} on the free list while in use"
            self._in_use[page] = True
            table.append(page)
        if len(table) > first or seq_id not in self._arrays:
            arr = self._arrays.get(seq_id)
            if arr is None or len(arr) < len(table):  # grow: the old array stays valid for views handed out
                grown = np.empty(max(16, 2 * len(table)), np.int64)
                if arr is not None:
                    grown[:first] = arr[:first]
                arr = self._arrays[seq_id] = grown
            arr[first:len(table)] = table[first:]
        return list(table)

    def table_view(self, seq_id: str) -> np.ndarray:
        """The sequence's page table as a read-only int64 array view ``[pages]`` (``KeyError`` if unknown), no
        copy: what a step's page tables are made of. Later growth never changes a view handed out (new pages
        land past its end, or in a new array); pages freed with the sequence are the caller's to stop using."""
        n = len(self._tables[seq_id])
        v = self._arrays[seq_id][:n]
        v.setflags(write=False)
        return v

    def page_table(self, seq_id: str) -> list[int]:
        """Copy of the sequence's page table (``KeyError`` if unknown)."""
        return list(self._tables[seq_id])

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tables

    def free(self, seq_id: str) -> None:
        """Return all of ``seq_id``'s pages to the pool. Unknown ids (double free) raise ``KeyError``."""
        table = self._tables[seq_id]  # KeyError on unknown / already freed
        for page in table:  # check everything before mutating, so a corrupt table changes nothing
            self._check_index(page)
            if not self._in_use[page]:
                raise RuntimeError(f"page {page} of {seq_id!r} is already free (corrupt page table)")
        del self._tables[seq_id]
        self._arrays.pop(seq_id, None)
        for page in table:
            self._in_use[page] = False
        # Freed pages go back so that the lowest indices are reused first.
        self._free.extend(table)
        self._free.sort(reverse=True)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def _check_index(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page index {page} outside the pool of {self.num_pages} pages")


@dataclass(frozen=True)
class KVLayout:
    """Geometry of the KV page pool. One page = K and V of ``page_size`` tokens in every attention layer.

    Buffer shape per layer and per K/V: ``[num_pages, page_size, num_kv_heads, head_dim]``.
    """

    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: Any = np.float32
    num_layers: int = 1  # full-attention layers sharing the page tables

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "num_kv_heads", "head_dim", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)}")
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    @property
    def page_shape(self) -> tuple[int, int, int]:
        """Shape of one page of one layer's K (or V) buffer: ``[page_size, num_kv_heads, head_dim]``."""
        return (self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def buffer_shape(self) -> tuple[int, int, int, int]:
        return (self.num_pages, *self.page_shape)

    @property
    def bytes_per_page(self) -> int:
        """Bytes one allocator page costs: K + V in every attention layer."""
        return 2 * self.num_layers * int(np.prod(self.page_shape)) * self.dtype.itemsize

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    @classmethod
    def pages_for_budget(cls, budget_bytes: int, num_attention_layers: int, page_size: int,
                         num_kv_heads: int, head_dim: int, dtype: Any = np.float32) -> KVLayout:
        """Largest pool that fits ``budget_bytes``; ``ValueError`` if not even one page fits."""
        one = cls(1, page_size, num_kv_heads, head_dim, dtype, num_attention_layers)
        pages = budget_bytes // one.bytes_per_page
        if pages < 1:
            raise ValueError(f"KV budget of {budget_bytes} bytes is below one page ({one.bytes_per_page} bytes)")
        return cls(int(pages), page_size, num_kv_heads, head_dim, dtype, num_attention_layers)


class KVCache:
    """K and V page pools for each full-attention layer, allocated once from a ``KVLayout``.

    ``layer_ids`` are the model's layer indices of the attention layers (e.g. 3, 7, 11, ...);
    their count must equal ``layout.num_layers``.
    """

    def __init__(self, layout: KVLayout, layer_ids: Iterable[int] | None = None) -> None:
        ids = list(range(layout.num_layers)) if layer_ids is None else list(layer_ids)
        if len(ids) != layout.num_layers or len(set(ids)) != len(ids):
            raise ValueError(f"need {layout.num_layers} distinct attention layer ids, got {ids}")
        self.layout = layout
        # resident from the start: a lazily mapped pool would grow the RSS each time usage hits a new high
        self._k = {i: resident_zeros(layout.buffer_shape, layout.dtype) for i in ids}
        self._v = {i: resident_zeros(layout.buffer_shape, layout.dtype) for i in ids}

    @property
    def layer_ids(self) -> list[int]:
        return list(self._k)

    def buffers(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """``(k_buf, v_buf)`` of a layer, each ``[num_pages, page_size, num_kv_heads, head_dim]``."""
        return self._k[layer], self._v[layer]

    def _slots(self, page_table: Sequence[int], start_pos: int, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """(page, offset) arrays for positions ``start_pos .. start_pos+num_tokens-1``, bounds-checked."""
        if start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {start_pos}")
        ps = self.layout.page_size
        pos = np.arange(start_pos, start_pos + num_tokens)
        table = np.asarray(page_table, dtype=np.int64)
        need = -(-(start_pos + num_tokens) // ps)
        if need > len(table):
            raise IndexError(f"page table of {len(table)} pages does not cover positions up to "
                             f"{start_pos + num_tokens - 1} (needs {need})")
        pages = table[pos // ps]
        if num_tokens and (pages.min() < 0 or pages.max() >= self.layout.num_pages):
            raise IndexError(f"page index outside the pool of {self.layout.num_pages} pages: {pages}")
        return pages, pos % ps

    def write(self, layer: int, page_table: Sequence[int], start_pos: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store ``k``, ``v`` ``[T, num_kv_heads, head_dim]`` at positions ``start_pos .. start_pos+T-1``."""
        shape = (k.shape[0], *self.layout.page_shape[1:])
        if k.shape != shape or v.shape != shape:
            raise ValueError(f"k/v must be {shape}, got {k.shape} and {v.shape}")
        pages, offs = self._slots(page_table, start_pos, k.shape[0])
        self._k[layer][pages, offs] = k
        self._v[layer][pages, offs] = v

    def read(self, layer: int, page_table: Sequence[int], start_pos: int, num_tokens: int
             ) -> tuple[np.ndarray, np.ndarray]:
        """Gather K, V ``[num_tokens, num_kv_heads, head_dim]`` of positions ``start_pos ..``; for tests/debug."""
        pages, offs = self._slots(page_table, start_pos, num_tokens)
        return self._k[layer][pages, offs], self._v[layer][pages, offs]
