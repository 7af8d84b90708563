"""State slots (invariant 5): the sink is never handed out, resets touch only their slot, bounds hold."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from hybrid_runtime.state_cache import NoFreeSlot, SlotAllocator, StateCache, StateLayout
from tests.hf_models import tiny_raw_config


def _cfg():
    from builder.hf_config import parse_hf_config

    return parse_hf_config(tiny_raw_config("qwen3_next"))[0]


def test_allocator_never_hands_out_the_sink_and_reuses_lowest_first() -> None:
    a = SlotAllocator(3)
    got = [a.allocate(f"r{i}") for i in range(3)]
    assert got == [0, 1, 2] and a.sink == 3 and a.sink not in got
    with pytest.raises(NoFreeSlot):
        a.allocate("r3")
    a.free(1)
    assert a.allocate("r4") == 1
    with pytest.raises(KeyError, match="double free"):
        a.free(3)
    a.free(0)
    with pytest.raises(KeyError):
        a.free(0)


def test_reset_zeroes_exactly_one_slot_in_every_layer() -> None:
    cfg = _cfg()
    sc = StateCache(cfg, num_slots=4)
    layout = sc.layout
    assert layout.rows == 5 and layout.sink == 4
    for layer in cfg.linear_layers:
        assert sc.conv[layer].shape == (5, cfg.conv_kernel - 1, cfg.conv_dim)
        assert sc.recurrent[layer].shape == (5, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                             cfg.linear_value_head_dim)
        sc.conv[layer][:] = 1.0
        sc.recurrent[layer][:] = 2.0
    sc.reset(2)
    for layer in cfg.linear_layers:
        assert not sc.conv[layer][2].any() and not sc.recurrent[layer][2].any()
        for other in (0, 1, 3, 4):
            assert (sc.conv[layer][other] == 1.0).all() and (sc.recurrent[layer][other] == 2.0).all()


@pytest.mark.parametrize("slot", [-1, 5, 100])
def test_out_of_range_slots_are_refused(slot: int) -> None:
    sc = StateCache(_cfg(), num_slots=4)
    with pytest.raises(IndexError, match="out of range"):
        sc.reset(slot)


def test_layout_offsets_match_the_buffers_it_allocated() -> None:
    layout = StateLayout(num_slots=3, conv_shape=(3, 10), recurrent_shape=(2, 4, 5))
    conv, rec = layout.allocate()
    assert conv.nbytes + rec.nbytes == layout.total_bytes
    for slot in range(layout.rows):
        (c_off, c_len), (r_off, r_len) = layout.offsets(slot)
        assert c_off == conv[slot].ctypes.data - conv.ctypes.data and c_len == conv[slot].nbytes
        assert r_off == rec[slot].ctypes.data - rec.ctypes.data and r_len == rec[slot].nbytes
    assert np.dtype(layout.dtype) == conv.dtype == rec.dtype


def _rss_anon_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_slot_rows_are_resident_at_allocation_and_the_sink_row_is_not() -> None:
    """The request slots' rows are committed at load (no RSS growth as slots are first used, issue 21); the
    padding sink, which the host operators never write, costs no memory (issue 18's RSS budget)."""
    from hybrid_runtime.host_memory import resident_zeros

    # 8 MiB rows: 40 MiB is over glibc's largest mmap threshold, so the buffer is fresh pages (not memory that
    # earlier tests freed and that is resident already)
    rows, row, mib = 5, (2048, 1024), 8
    before = _rss_anon_mib()
    buf = resident_zeros((rows, *row), np.float32, resident_rows=rows - 1)
    grown = _rss_anon_mib() - before
    assert 0.9 * (rows - 1) * mib <= grown < (rows - 0.5) * mib, grown
    assert not buf.any()  # the lazily mapped row reads back zeros (reading maps the shared zero page)
    full = resident_zeros((rows, *row), np.float32)
    assert _rss_anon_mib() - before - grown > 0.9 * rows * mib and not full.any()
