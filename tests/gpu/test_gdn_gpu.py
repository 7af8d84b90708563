"""GDN kernels on the GPU against the numpy operators (hybrid_runtime/ops/gdn.py): conv + delta rule for
decode and prefill, arbitrary slots, padding rows on the sink, resets, and a long admit/decode/free run."""

from __future__ import annotations

import numpy as np
import pytest
from gdn_cases import Shape, Twin, rel

pytestmark = pytest.mark.gpu

O_TOL = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-4}
S_TOL = 2e-4  # float32 state: only the arithmetic order differs (chunked WY vs scan in prefill)


@pytest.fixture(scope="module")
def dev():
    import torch

    torch.cuda.init()
    from hybrid_runtime.cuda.driver import CudaDevice

    return CudaDevice(0)


def check_state(tw: Twin, live: np.ndarray, untouched: np.ndarray) -> None:
    conv, rec = tw.state()
    if live.size:
        assert rel(conv[live], tw.conv_np[live]) < S_TOL
        assert rel(rec[live], tw.rec_np[live]) < S_TOL
    # rows nobody touched are bit-identical (the sink is excluded from both sets)
    assert np.array_equal(conv[untouched], tw.conv_np[untouched])
    assert np.array_equal(rec[untouched], tw.rec_np[untouched])


@pytest.mark.parametrize("batch", [1, 2, 3, 16, 64])
@pytest.mark.parametrize("act", ["bfloat16", "float16"])
def test_decode_random_slots_with_padding(dev, batch: int, act: str) -> None:
    tw = Twin(dev, Shape(), num_slots=100, act=act, seed=batch)
    rng = np.random.default_rng(batch + 7)
    touched: set[int] = set()
    for step in range(3):
        live = rng.choice(100, size=batch, replace=False)  # non-contiguous, any order
        touched |= set(live.tolist())
        pad = int(rng.integers(0, 5))
        slots = np.concatenate([live, np.full(pad, tw.sink)]).astype(np.int64)
        rng.shuffle(slots)
        o, o_ref = tw.decode(slots)
        rows = slots != tw.sink
        assert np.isfinite(o).all()
        assert rel(o[rows], o_ref[rows]) < O_TOL[act], f"step {step}"
        done = np.array(sorted(touched))
        check_state(tw, done, np.setdiff1d(np.arange(100), done))


def test_decode_qwen35_shapes(dev) -> None:
    """16 key heads, 32 value heads, dk = dv = 128 (Qwen3.5-35B-A3B), batch 3 with a padding row."""
    tw = Twin(dev, Shape(nk=16, nv=32, dk=128, dv=128, K=4), num_slots=6, act="bfloat16", seed=5)
    slots = np.array([4, tw.sink, 0, 2])
    for _ in range(2):
        o, o_ref = tw.decode(slots)
        assert rel(o[[0, 2, 3]], o_ref[[0, 2, 3]]) < O_TOL["bfloat16"]
    check_state(tw, np.array([0, 2, 4]), np.array([1, 3, 5]))


@pytest.mark.parametrize("act", ["bfloat16", "float32"])
def test_prefill_chunks_continue_from_state(dev, act: str) -> None:
    """Several sequences packed, lengths around the window (K-1 = 3) and the scan chunk, continuing from
    non-zero states; then a second prefill chunk of the same sequences."""
    tw = Twin(dev, Shape(nk=2, nv=4, dk=64, dv=32, K=4), num_slots=20, act=act, seed=11)
    slots, lens = [7, 2, 13, 0, 19], [1, 2, 5, 70, 150]
    for _ in range(2):
        o, o_ref = tw.prefill(slots, lens)
        assert np.isfinite(o).all()
        assert rel(o, o_ref) < O_TOL[act]
        check_state(tw, np.sort(slots), np.setdiff1d(np.arange(20), slots))


def test_prefill_long_prompt_qwen35_shape(dev) -> None:
    tw = Twin(dev, Shape(nk=16, nv=32, dk=128, dv=128, K=4), num_slots=3, act="bfloat16", seed=3,
              random_state=False)
    o, o_ref = tw.prefill([1], [300])
    assert rel(o, o_ref) < O_TOL["bfloat16"]
    check_state(tw, np.array([1]), np.array([0, 2]))


def test_slots_reused_after_reset(dev) -> None:
    tw = Twin(dev, Shape(), num_slots=8, act="bfloat16", seed=21)
    tw.prefill([3, 5], [9, 4])
    tw.decode(np.array([3, 5, tw.sink]))
    # sequence on slot 3 finishes; a new one is admitted to the same slot: reset, prefill, decode
    tw.reset(3)
    conv, rec = tw.state()
    assert not conv[3].any() and not rec[3].any()
    o, o_ref = tw.prefill([3], [6])
    assert rel(o, o_ref) < O_TOL["bfloat16"]
    o, o_ref = tw.decode(np.array([5, 3]))
    assert rel(o, o_ref) < O_TOL["bfloat16"]
    check_state(tw, np.array([3, 5]), np.array([0, 1, 2, 4, 6, 7]))
    with pytest.raises(IndexError):
        tw.cache.reset(9)  # rows are 0..8 (8 = sink): 9 is out of range, caught before the memset


def test_bad_slots_are_rejected_before_launch(dev) -> None:
    tw = Twin(dev, Shape(), num_slots=8, act="bfloat16", seed=1)
    with pytest.raises(IndexError):
        tw.decode(np.array([0, 9]))
    with pytest.raises(IndexError):
        tw.decode(np.array([-1]))
    with pytest.raises(ValueError):
        tw.decode(np.array([2, 2]))  # two live rows on one slot
    tw.decode(np.array([2, 8, 8]))  # the sink may repeat


def test_stress_admit_decode_free(dev) -> None:
    """A few thousand steps of random admissions (reset + prefill), decodes at batch <= 64 (padded to a
    multiple of 8 with sink rows, rows in random order) and frees; every live slot is compared at the end."""
    from hybrid_runtime.state_cache import SlotAllocator

    num_slots = 80
    tw = Twin(dev, Shape(nk=2, nv=4, dk=16, dv=16, K=4), num_slots=num_slots, act="bfloat16", seed=99,
              random_state=False)
    alloc = SlotAllocator(num_slots)
    rng = np.random.default_rng(123)
    live: list[int] = []
    steps = 3000
    max_o_err = 0.0
    for step in range(steps):
        if len(live) < 64 and rng.random() < 0.3:
            new = []
            for _ in range(int(rng.integers(1, 4))):
                if len(live) + len(new) >= 64:
                    break
                slot = alloc.allocate(f"r{step}-{len(new)}")
                tw.reset(slot)
                new.append(slot)
            if new:
                tw.prefill(new, [int(rng.integers(1, 24)) for _ in new])
                live += new
        if live:
            rows = np.array(live + [tw.sink] * ((-len(live)) % 8), np.int64)
            rng.shuffle(rows)
            o, o_ref = tw.decode(rows)
            keep = rows != tw.sink
            max_o_err = max(max_o_err, rel(o[keep], o_ref[keep]))
        if live and rng.random() < 0.25:
            for slot in rng.choice(live, size=int(rng.integers(1, min(4, len(live)) + 1)), replace=False):
                live.remove(int(slot))
                alloc.free(int(slot))
    assert max_o_err < O_TOL["bfloat16"]
    live_arr = np.sort(np.array(live, np.int64))
    conv, rec = tw.state()
    assert live_arr.size > 0
    assert rel(conv[live_arr], tw.conv_np[live_arr]) < S_TOL
    assert rel(rec[live_arr], tw.rec_np[live_arr]) < 1e-3  # thousands of steps of float32 drift


def test_state_layout_drives_allocation_and_reset(dev) -> None:
    from hybrid_runtime.cuda.state import DeviceStateCache
    from hybrid_runtime.state_cache import StateLayout

    layout = StateLayout(5, (3, 40), (2, 8, 12))
    cache = DeviceStateCache(dev, layout, layers=[0, 4])
    assert cache.conv[4].nbytes == layout.rows * layout.conv_row_bytes
    assert cache.recurrent[0].nbytes == layout.rows * layout.recurrent_row_bytes
    ones_c = np.ones((layout.rows, 3, 40), np.float32)
    ones_r = np.ones((layout.rows, 2, 8, 12), np.float32)
    cache.upload_layer(0, ones_c, ones_r)
    cache.upload_layer(4, ones_c, ones_r)
    cache.reset(2)
    for layer in (0, 4):
        c, r = cache.download_layer(layer)
        assert not c[2].any() and not r[2].any()
        assert (c[[0, 1, 3, 4, 5]] == 1).all() and (r[[0, 1, 3, 4, 5]] == 1).all()
