"""The tensor-core prefill MoE (``ops/cuda/moe_gemm.cu``, ``cuda/moe_prefill.py``) on any machine: NVRTC compiles
both dtypes for sm_90 without spills, the host's bounds (tile list, routing geometry, shapes), and a lane-level
numpy model of the kernels (``moe_gemm_model.py``: grouping, tile list, one GEMM CTA with its swizzled
shared-memory ring, ldmatrix addressing and mma fragments) against plain numpy."""

from __future__ import annotations

import numpy as np
import pytest
from moe_gemm_model import gemm_cta_model, group_model
from test_cuda_compile import check_log, nvrtc_or_skip

from hybrid_runtime.cuda.moe_prefill import (
    GEMM_BM,
    GEMM_SMEM,
    ROUTE_MAX_CTAS,
    ROUTE_MIN_CHUNK,
    MoEPrefill,
    max_tiles,
    route_geometry,
    supported,
    tile_list,
    tile_list_words,
)


@pytest.mark.parametrize("dt", [1, 2])
def test_moe_gemm_compiles_for_sm90_without_spills(dt: int) -> None:
    nvrtc_or_skip()
    import re

    from hybrid_runtime.cuda.kernels import compile_log, source

    log = compile_log(source("moe_gemm.cu"), "moe_gemm.cu", (f"-DDT={dt}",), "sm_90")
    check_log(log)
    for name in ("moe_topk", "moe_group", "moe_gemm_gate_up", "moe_gemm_down", "moe_gemm_down_t"):
        assert f"'{name}'" in log, log
    # two GEMM CTAs per SM: <= 255 registers x 128 threads each, static + dynamic smem <= 227 KB each
    smem = [int(m) for m in re.findall(r"(\d+) bytes smem", log)]
    assert 2 * (max(smem) + GEMM_SMEM + 1024) <= 228 * 1024, log


def test_float32_is_not_a_tensor_core_dtype() -> None:
    assert not supported("float32", 2048, 512, 256, 8)
    assert supported("bfloat16", 2048, 512, 256, 8) and supported("float16", 128, 128, 8, 2)
    assert not supported("bfloat16", 64, 512, 256, 8)  # H % 128
    assert not supported("bfloat16", 2048, 96, 256, 8)  # I % 64
    assert not supported("bfloat16", 2048, 512, 1025, 8)
    with pytest.raises(ValueError, match="bfloat16"):
        MoEPrefill(None, "float32")  # type: ignore[arg-type]


def test_route_geometry() -> None:
    assert ROUTE_MIN_CHUNK == 8 and route_geometry(1) == (1, 8)
    assert route_geometry(8) == (1, 8) and route_geometry(9) == (2, 8) and route_geometry(1024) == (128, 8)
    assert route_geometry(8192) == (128, 64)
    for n in (1, 7, 100, 4095, 4096, 4097, 8191, 65536, 100_000):
        ncta, chunk = route_geometry(n)
        assert ncta <= ROUTE_MAX_CTAS and (ncta - 1) * chunk < n <= ncta * chunk
    with pytest.raises(ValueError):
        route_geometry(0)


def test_tile_bound_holds_for_every_routing() -> None:
    rng = np.random.default_rng(0)
    for pairs, e_all in [(1, 256), (8, 256), (7 * 8, 256), (1000 * 8, 256), (8192 * 8, 256), (300, 16), (5, 1)]:
        cases = [rng.multinomial(pairs, np.ones(e_all) / e_all) for _ in range(20)]
        one = np.zeros(e_all, np.int64)
        one[e_all // 2] = pairs
        cases.append(one)  # one expert takes all
        spread = np.zeros(e_all, np.int64)  # as many experts as possible with one pair past a full tile
        for i in range(pairs):
            spread[i % e_all] += 1
        cases.append(spread)
        for c in cases:
            tl = tile_list(c)
            assert len(tl) == sum(-(-int(x) // GEMM_BM) for x in c) <= max_tiles(pairs, e_all)
            assert tl[:, 2].sum() == pairs and tl[:, 2].min(initial=GEMM_BM) >= 1 and tl[:, 2].max() <= GEMM_BM
    assert max_tiles(8192 * 8, 256) == 512 + 256
    assert tile_list_words(8192 * 8, 257) == 4 + 4 * (1024 + 257)  # room for 64-row tiles (the 64-row build)


@pytest.mark.parametrize("n,kk,e_all,chunk", [(1, 8, 256, 32), (7, 8, 256, 32), (64, 8, 256, 32), (300, 4, 16, 32),
                                              (500, 8, 256, 200), (100, 3, 5, 32), (100, 8, 256, 8)])
def test_grouping_model_is_moe_routes_contract(n: int, kk: int, e_all: int, chunk: int) -> None:
    """moe_group's algorithm (per-CTA counts, scans, warp-by-warp placement; chunk 200 x kk 8 = two rounds of
    1024 pairs per CTA) == a stable sort of the pairs by expert, and its tiles == tile_list()."""
    rng = np.random.default_rng(n)
    logits = rng.standard_normal((n, e_all))
    if n == 300:
        logits[:, 3] += 30  # one expert takes every token; others none
    pair_e = np.argsort(-logits, 1, kind="stable")[:, :kk].reshape(-1)
    off, pl, active, tiles = group_model(pair_e, n, kk, e_all, chunk)
    counts = np.bincount(pair_e, minlength=e_all)
    assert off.tolist() == [0, *np.cumsum(counts).tolist()]
    assert pl.tolist() == np.argsort(pair_e, kind="stable").tolist()  # ascending pairs within each expert
    na = int(active[e_all])
    assert active[:na].tolist() == np.nonzero(counts)[0].tolist()
    assert np.array_equal(tiles, tile_list(counts))


@pytest.mark.parametrize("rows", [1, 17, 64, 100, 128])
def test_gemm_cta_model_matches_numpy(rows: int) -> None:
    """One CTA of each grouped GEMM, modelled lane by lane (4 k tiles > 3 stages; a partial tile skips m-tiles)
    == numpy on the same gathered rows: gate_up's SwiGLU columns and down's weighted y slots."""
    rng = np.random.default_rng(rows)
    H, I, kk, ny, E, n = 256, 128, 4, 5, 3, 64
    e = 1
    ldh = H + 64
    h = rng.standard_normal((n, ldh))
    gu = rng.standard_normal((E, 2 * I, H))
    dn = rng.standard_normal((E, H, I))
    pairs = rng.permutation(n * kk)[:rows]
    pair_list = np.concatenate([rng.integers(0, n * kk, 5), pairs, rng.integers(0, n * kk, 3)])
    start = 5
    pair_w = rng.random(n * kk)
    act = np.full(n * kk * I, np.nan)
    for bx in range(I // 64):
        gemm_cta_model("gate_up", h.ravel(), ldh, gu.ravel(), H, I, H, kk, ny, (e, start, rows), pair_list, None, bx,
                       act)
    act = act.reshape(n * kk, I)
    x = h[pairs // kk, :H] @ gu[e].T
    want = x[:, :I] / (1 + np.exp(-x[:, :I])) * x[:, I:]
    np.testing.assert_allclose(act[pairs], want, rtol=1e-10, atol=1e-10)
    others = np.setdiff1d(np.arange(n * kk), pairs)
    assert np.isnan(act[others]).all()
    a_in = rng.standard_normal((n * kk, I))
    y = np.full(n * ny * H, np.nan)
    for bx in range(H // 128):
        gemm_cta_model("down", a_in.ravel(), I, dn.ravel(), I, I, H, kk, ny, (e, start, rows), pair_list, pair_w, bx,
                       y)
    y = y.reshape(n, ny, H)
    want = pair_w[pairs, None] * (a_in[pairs] @ dn[e].T)
    np.testing.assert_allclose(y[pairs // kk, pairs % kk], want, rtol=1e-10, atol=1e-10)
    written = np.zeros((n, ny), bool)
    written[pairs // kk, pairs % kk] = True
    assert np.isnan(y[~written]).all()
