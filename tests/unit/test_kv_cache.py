"""Page allocator bookkeeping and KV buffer writes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from hybrid_runtime.kv_cache import KVCache, KVLayout, OutOfPages, PageAllocator


def test_grow_allocates_only_missing_pages() -> None:
    a = PageAllocator(num_pages=8, page_size=4)
    assert a.pages_needed(0) == 0 and a.pages_needed(1) == 1 and a.pages_needed(4) == 1 and a.pages_needed(5) == 2
    assert a.allocate("s", 5) == [0, 1]
    assert a.allocate("s", 8) == [0, 1]  # still covered
    assert a.allocate("s", 9) == [0, 1, 2]
    assert a.allocate("s", 3) == [0, 1, 2]  # never shrinks
    assert a.allocate("t", 1) == [3]
    assert a.page_table("s") == [0, 1, 2] and "s" in a and "u" not in a
    assert (a.num_used, a.num_free) == (4, 4)
    a.page_table("s").append(99)  # a copy: callers cannot corrupt the table
    assert a.page_table("s") == [0, 1, 2]


def test_free_returns_pages_and_double_free_raises() -> None:
    a = PageAllocator(6, 2)
    a.allocate("a", 4)
    a.allocate("b", 4)
    a.free("a")
    assert a.num_free == 4 and "a" not in a
    assert a.allocate("c", 6) == [0, 1, 4]  # lowest indices reused first
    with pytest.raises(KeyError):
        a.free("a")
    with pytest.raises(KeyError):
        a.free("never")
    with pytest.raises(KeyError):
        a.page_table("a")


def test_out_of_pages_leaves_state_unchanged() -> None:
    a = PageAllocator(4, 16)
    a.allocate("a", 33)  # 3 pages
    with pytest.raises(OutOfPages):
        a.allocate("a", 16 * 5)
    with pytest.raises(OutOfPages):
        a.allocate("b", 16 * 2)
    assert isinstance(OutOfPages("x"), RuntimeError)
    assert a.page_table("a") == [0, 1, 2] and a.num_free == 1 and "b" not in a
    assert a.can_allocate(1) and not a.can_allocate(2)
    assert a.allocate("b", 16) == [3]


def test_bounds_and_bad_arguments() -> None:
    with pytest.raises(ValueError):
        PageAllocator(0, 4)
    a = PageAllocator(2, 4)
    with pytest.raises(ValueError):
        a.allocate("x", -1)
    a.allocate("x", 8)
    a._tables["x"][1] = 7  # simulate a corrupt table: freeing it must not touch the pool
    with pytest.raises(IndexError):
        a.free("x")
    assert "x" in a and a.num_used == 2  # nothing changed


def test_layout_sizes_and_budget() -> None:
    lay = KVLayout(num_pages=10, page_size=16, num_kv_heads=2, head_dim=64, dtype=np.float16, num_layers=3)
    assert lay.page_shape == (16, 2, 64) and lay.buffer_shape == (10, 16, 2, 64)
    assert lay.bytes_per_page == 2 * 3 * 16 * 2 * 64 * 2
    assert lay.total_bytes == 10 * lay.bytes_per_page
    fit = KVLayout.pages_for_budget(lay.total_bytes + lay.bytes_per_page - 1, 3, 16, 2, 64, np.float16)
    assert fit.num_pages == 10 and fit.total_bytes <= lay.total_bytes + lay.bytes_per_page
    with pytest.raises(ValueError):
        KVLayout.pages_for_budget(10, 3, 16, 2, 64)
    with pytest.raises(ValueError):
        KVLayout(0, 16, 2, 64)


def test_cache_write_read_back_across_pages() -> None:
    rng = np.random.default_rng(0)
    lay = KVLayout(num_pages=6, page_size=4, num_kv_heads=2, head_dim=8, num_layers=2)
    cache = KVCache(lay, layer_ids=[3, 7])
    assert cache.layer_ids == [3, 7] and cache.buffers(3)[0].shape == lay.buffer_shape
    table = [5, 2, 0]
    k = rng.standard_normal((11, 2, 8)).astype(np.float32)
    v = rng.standard_normal((11, 2, 8)).astype(np.float32)
    cache.write(7, table, 0, k[:3], v[:3])  # chunked: 3 + 8 tokens
    cache.write(7, table, 3, k[3:], v[3:])
    rk, rv = cache.read(7, table, 0, 11)
    np.testing.assert_array_equal(rk, k)
    np.testing.assert_array_equal(rv, v)
    kb, _ = cache.buffers(7)
    np.testing.assert_array_equal(kb[2, 1], k[5])  # position 5 -> page table[1] = 2, offset 1
    assert not cache.buffers(3)[0].any()  # other layer untouched


def test_cache_write_bounds_checked() -> None:
    cache = KVCache(KVLayout(num_pages=4, page_size=4, num_kv_heads=1, head_dim=4))
    x = np.zeros((5, 1, 4), np.float32)
    with pytest.raises(IndexError):
        cache.write(0, [0], 0, x, x)  # table covers 4 positions only
    with pytest.raises(IndexError):
        cache.write(0, [0, -1], 0, x, x)  # negative index would wrap silently in numpy
    with pytest.raises(IndexError):
        cache.write(0, [0, 4], 0, x, x)
    with pytest.raises(ValueError):
        cache.write(0, [0, 1], 0, x, x[:, :, :2])
    with pytest.raises(ValueError):
        KVCache(KVLayout(4, 4, 1, 4, num_layers=2), layer_ids=[1, 1])


def _rss_anon_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_pool_is_resident_at_allocation_not_on_first_use() -> None:
    # 2 layers x (K + V) x 8 MiB: with np.zeros (calloc) of fresh pages none of it would be resident yet, and the
    # RSS would grow each time the pages in use reached a new high (the soak's slow growth). Measured as what the
    # first use adds after the allocation: the allocation itself may reuse memory earlier tests freed (resident
    # already), so the process's growth at allocation says nothing in a full test run.
    layout = KVLayout(num_pages=1024, page_size=16, num_kv_heads=2, head_dim=64, num_layers=2)
    cache = KVCache(layout)
    bufs = [b for layer in range(layout.num_layers) for b in cache.buffers(layer)]
    assert not any(b.any() for b in bufs)
    after_alloc = _rss_anon_mib()
    for b in bufs:
        b.fill(1)  # every page written: a lazily mapped pool would become resident only now
    grown_on_use = _rss_anon_mib() - after_alloc
    assert grown_on_use < 0.1 * layout.total_bytes / 2**20, grown_on_use


def test_table_view_is_the_table_read_only_and_stable_across_growth() -> None:
    """table_view: the same pages as page_table as a read-only int64 array, without a copy per call; a view
    handed out keeps its pages while the table grows past the array's capacity, and unknown ids raise."""
    a = PageAllocator(num_pages=200, page_size=4)
    a.allocate("s", 5)
    v0 = a.table_view("s")
    assert v0.dtype == np.int64 and v0.tolist() == a.page_table("s") == [0, 1]
    with pytest.raises(ValueError):
        v0[0] = 7  # read-only: a backend cannot corrupt the allocator's table
    a.allocate("t", 4)  # interleaved growth: the tables stay separate
    a.allocate("s", 4 * 40)  # past the first array's capacity (16): a new array
    v1 = a.table_view("s")
    assert v1.tolist() == a.page_table("s") and len(v1) == 40 and v0.tolist() == [0, 1]
    assert a.table_view("s").base is v1.base  # no copy per call
    assert a.table_view("t").tolist() == [2]
    a.free("s")
    with pytest.raises(KeyError):
        a.table_view("s")
    a.allocate("s", 4)  # a new sequence of the same id starts a new table
    assert a.table_view("s").tolist() == a.page_table("s") and v1.tolist()[:2] == [0, 1]
