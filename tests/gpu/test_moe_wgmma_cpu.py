"""The wgmma build of the prefill MoE's grouped GEMMs (``ops/cuda/moe_wgmma.cu``) on any machine: NVRTC compiles
both variants and dtypes for sm_90a without spills or serialised wgmma, the stage layout the cp.async copies
write is the canonical K-major 128B-swizzle layout the matrix descriptors declare (per the PTX ISA), the ring's
schedule never overwrites a stage an MMA may still read, and a lane-level model of one CTA (copies -> shared
memory -> descriptor reads -> accumulator fragments -> epilogues, ``moe_wgmma_model.py``) == numpy."""

from __future__ import annotations

import re

import numpy as np
import pytest
from moe_wgmma_model import (
    ROWB,
    accumulator_position,
    canonical_k_major_address,
    cu_defines,
    ring_schedule,
    wg_desc,
    wg_off,
    wgmma_cta_model,
    ws_cta_model,
    ws_defines,
    ws_items,
    ws_protocol_sim,
)
from test_cuda_compile import check_log, nvrtc_or_skip

from hybrid_runtime.cuda.moe_prefill import (
    AUTO_IMPL,
    GEMM_BM,
    IMPLS,
    PACKED_VARIANTS,
    SMALL_BM,
    WGMMA_ARCH,
    WGMMA_VARIANTS,
    MoEPrefill,
    zero_points_i32,
)

VARIANTS = sorted(WGMMA_VARIANTS)


@pytest.mark.parametrize("impl", VARIANTS)
@pytest.mark.parametrize("dt", [1, 2])
def test_moe_wgmma_compiles_for_sm90a_without_spills(impl: str, dt: int) -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source

    v = WGMMA_VARIANTS[impl]
    log = compile_log(source(v.source), v.source, (f"-DDT={dt}", *v.options), WGMMA_ARCH)
    check_log(log)
    for name in ("moe_wgmma_gate_up", "moe_wgmma_down", "moe_wgmma_down_t"):
        assert f"'{name}'" in log, log
    assert "wgmma.mma_async instructions are serialized" not in log, log  # C7518: no async MMA then
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", log)]
    static = max(int(m) for m in re.findall(r"(\d+) bytes smem", log))
    ctas = 1 if v.bn == 256 else 2  # __launch_bounds__(threads, WG_MINB or 1)
    assert max(regs) * v.threads * ctas <= 65536, log
    assert ctas * (static + v.smem + 1024) <= 228 * 1024 and static + v.smem <= 227 * 1024, log


def test_variant_constants_match_the_source() -> None:
    d = cu_defines()
    assert d["WG_BM"] == GEMM_BM and d["WG_BK"] == 64  # WG_THREADS = 2 * WG_BM (one warpgroup per 64 rows)
    w64 = WGMMA_VARIANTS["wgmma64"]
    assert (w64.bm, w64.bn, w64.threads) == (SMALL_BM, 256, 2 * SMALL_BM) and "-DWG_BM=64" in w64.options
    assert w64.smem == 4 * (64 + 256) * 128 + 1024 and w64.takes(2048, 512) and not w64.takes(128, 128)
    assert "-DWG_BM=64" not in WGMMA_VARIANTS["wgmma"].options  # the default build's options are unchanged
    assert (d["WG_BN"], d["WG_STAGES"], d["WG_INFLIGHT"]) == (256, 4, 1)  # the defaults == "wgmma"
    w = WGMMA_VARIANTS["wgmma"]
    assert (w.bn, w.stages, w.inflight) == (256, 4, 1) and w.smem == 4 * (128 + 256) * 128 + 1024
    assert WGMMA_VARIANTS["wgmma128"].smem == 3 * (128 + 128) * 128 + 1024
    assert d["WG_SBO"] == 1024 and d["WG_SWIZZLE_128B"] == 1 and d["WG_LBO"] == 16
    assert w.takes(2048, 512) and w.takes(256, 128) and not w.takes(128, 128) and not w.takes(2048, 64)
    assert WGMMA_VARIANTS["wgmma128"].takes(128, 128) and not WGMMA_VARIANTS["wgmma128"].takes(64, 128)
    assert AUTO_IMPL in IMPLS and AUTO_IMPL != "auto"
    ws, dws = WGMMA_VARIANTS["wgmma_ws"], ws_defines()
    assert (ws.bn, ws.stages, ws.lag, ws.threads, ws.persistent) == (dws["WS_BN"], dws["WS_STAGES"], dws["WS_LAG"],
                                                                      dws["WS_THREADS"], True)
    assert ws.source == "moe_wgmma_ws.cu" and ws.smem == dws["WS_STAGES"] * (128 + 256) * 128 + 1024 == w.smem
    assert dws["WS_BM"] == GEMM_BM and dws["WS_BK"] == 64 and dws["WS_CONSUMERS"] + dws["WS_PRODUCERS"] == 384
    assert (dws["WS_SBO"], dws["WS_LBO"], dws["WS_SWIZZLE_128B"]) == (d["WG_SBO"], d["WG_LBO"], d["WG_SWIZZLE_128B"])
    assert dws["WS_PRODUCERS"] == dws["WS_PROD_ROWS"] * 8 and 1 <= ws.lag <= ws.stages - 2
    assert ws.options == ("-DWS_STAGES=4", "-DWS_LAG=1") and ws.takes(2048, 512) and not ws.takes(128, 128)
    assert ws.grid(4, 1000, 132) == (132, 1, 1) and ws.grid(8, 3, 132) == (24, 1, 1) and w.grid(4, 9, 132) == (4, 9, 1)
    with pytest.raises(ValueError, match="impl"):
        MoEPrefill(None, "bfloat16", impl="tcgen05")  # type: ignore[arg-type]


@pytest.mark.parametrize("bn", [256, 128])
def test_descriptor_layout_is_what_the_copies_write(bn: int) -> None:
    """Every element (row, k) of every k16 step of every stage: the byte the descriptor makes wgmma read ==
    the byte the cp.async copy of chunk k / 8 of that row wrote (A of each warpgroup: 64 rows; B: bn rows)."""
    d = cu_defines()
    stages, stage_bytes, a_bytes = 4, (128 + bn) * ROWB, 128 * ROWB
    for sbase in (0x0000, 0x1400 & ~1023, 0x2C00):
        for stage in range(stages):
            sA = sbase + stage * stage_bytes
            tiles = [(sA + wg * 64 * ROWB, 64) for wg in range(2)] + [(sA + a_bytes, bn)]
            for base, nrows in tiles:
                assert base % 1024 == 0
                rows = np.arange(nrows)[:, None]
                for s in range(4):
                    kk = 16 * s + np.arange(16)[None, :]
                    wrote = base + np.vectorize(wg_off)(rows, kk // 8) + 2 * (kk % 8)
                    reads = canonical_k_major_address(wg_desc(base, d) + 2 * s, rows, kk - 16 * s)
                    assert np.array_equal(reads, wrote), (sbase, stage, base, s)
                # and the map is one-to-one onto the tile's bytes (even addresses)
                allk = np.arange(64)[None, :]
                wrote = base + np.vectorize(wg_off)(rows, allk // 8) + 2 * (allk % 8)
                assert np.array_equal(np.sort(wrote.ravel()), base + 2 * np.arange(nrows * 64))


def test_accumulator_fragment_covers_d_once() -> None:
    for n in (128, 256):
        seen = np.zeros((64, n), int)
        for t in range(128):
            for i in range(n // 2):
                seen[accumulator_position(t, i)] += 1
        assert (seen == 1).all()
    assert accumulator_position(0, 0) == (0, 0) and accumulator_position(37, 6) == (16 + 1 + 8, 8 + 2 + 0)


@pytest.mark.parametrize("stages,inflight", [(4, 1), (3, 0)])
@pytest.mark.parametrize("kt_count", [1, 2, 3, 4, 5, 8, 32])
def test_ring_never_overwrites_a_stage_in_use(stages: int, inflight: int, kt_count: int) -> None:
    """A copy into a stage (iteration j, after the barrier) comes after every MMA on that stage has completed in
    an iteration < j (each thread waited, then the barrier); an MMA of tile kt reads the stage after tile kt
    landed, and no other tile was copied there in between."""
    ev = ring_schedule(kt_count, stages, inflight)
    for i, (what, kt, st, it) in enumerate(ev):
        if what == "copy":
            for what2, kt2, st2, _ in ev[:i]:
                if what2 == "mma" and st2 == st:
                    done = [x for x in ev[:i] if x[0] == "done" and x[1] == kt2]
                    assert done and done[0][3] < it, (kt, kt2, ev)
        if what == "mma":
            land = [j for j, x in enumerate(ev[:i]) if x[0] == "land" and x[1] == kt]
            assert land, (kt, ev)
            copy = max(j for j, x in enumerate(ev[:i]) if x[0] == "copy" and x[2] == st)
            assert ev[copy][1] == kt, (kt, ev)
    assert sorted(x[1] for x in ev if x[0] == "mma") == list(range(kt_count))
    # the loop guarantees all but the last `inflight` tiles' MMAs; the kernel's wgmma.wait_group 0 the rest
    assert sorted(x[1] for x in ev if x[0] == "done") == list(range(kt_count - inflight))


@pytest.mark.parametrize("bn,bm", [(256, 128), (128, 128), (256, 64)])
@pytest.mark.parametrize("rows", [1, 63, 64, 100, 128])
def test_wgmma_cta_model_matches_numpy(bn: int, bm: int, rows: int) -> None:
    """One CTA of each GEMM (gate_up K = 256: 4 k tiles; down K = 128) == numpy on the same gathered rows."""
    rng = np.random.default_rng(rows + bn)
    H, I, kk, ny, E, n = 256, 128, 4, 5, 3, 64
    e, ldh, start = 2, 256 + 64, 5
    h = rng.standard_normal((n, ldh))
    gu = rng.standard_normal((E, 2 * I, H))
    dn = rng.standard_normal((E, H, I))
    pairs = rng.permutation(n * kk)[:rows]
    pair_list = np.concatenate([rng.integers(0, n * kk, start), pairs, rng.integers(0, n * kk, 3)])
    pair_w = rng.random(n * kk)
    stages = WGMMA_VARIANTS["wgmma" if bn == 256 else "wgmma128"].stages
    rows = min(rows, bm)  # a tile of the 64-row build holds at most 64 pairs
    pairs = pairs[:rows]
    act = np.full(n * kk * I, np.nan)
    for bx in range(I // (bn // 2)):
        wgmma_cta_model("gate_up", h.ravel(), ldh, gu.ravel(), H, I, H, kk, ny, (e, start, rows), pair_list, None,
                        bx, act, bn=bn, stages=stages, bm=bm)
    act = act.reshape(n * kk, I)
    x = h[pairs // kk, :H] @ gu[e].T
    np.testing.assert_allclose(act[pairs], x[:, :I] / (1 + np.exp(-x[:, :I])) * x[:, I:], rtol=1e-10, atol=1e-10)
    assert np.isnan(act[np.setdiff1d(np.arange(n * kk), pairs)]).all()
    a_in = rng.standard_normal((n * kk, I))
    y = np.full(n * ny * H, np.nan)
    for bx in range(H // bn):
        wgmma_cta_model("down", a_in.ravel(), I, dn.ravel(), I, I, H, kk, ny, (e, start, rows), pair_list, pair_w,
                        bx, y, bn=bn, stages=stages, bm=bm)
    y = y.reshape(n, ny, H)
    np.testing.assert_allclose(y[pairs // kk, pairs % kk], pair_w[pairs, None] * (a_in[pairs] @ dn[e].T),
                               rtol=1e-10, atol=1e-10)
    written = np.zeros((n, ny), bool)
    written[pairs // kk, pairs % kk] = True
    assert np.isnan(y[~written]).all()


class _FakeKernel:
    def set_max_dynamic_smem(self, device: object, nbytes: int) -> int:
        return nbytes


class _FakeModule:
    def kernel(self, name: str) -> _FakeKernel:
        return _FakeKernel()


class _FakeDevice:
    def __init__(self, cc: tuple[int, int]) -> None:
        self.compute_capability, self.arch = cc, f"sm_{cc[0]}{cc[1]}"


def test_impl_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto -> AUTO_IMPL on compute capability 9.0 only, mma elsewhere or when the wgmma module fails to
    build; an explicit wgmma off 9.0 is an error; AUTO_IMPL = "mma" switches the default back."""
    import hybrid_runtime.cuda.moe_prefill as mp

    loads: list[tuple[str, str]] = []

    def fake_load(src: str, options: tuple[str, ...], arch: str) -> _FakeModule:
        loads.append((src, arch))
        return _FakeModule()

    monkeypatch.setattr(mp, "load_module", fake_load)
    dev = _FakeDevice((9, 0))
    m = mp.MoEPrefill(dev, "bfloat16")  # type: ignore[arg-type]
    assert m.impl == mp.AUTO_IMPL == "wgmma_ws" and ("moe_wgmma_ws.cu", "sm_90a") in loads
    assert m.gemm_impl(2048, 512) == "wgmma_ws" and m.gemm_impl(128, 128) == "mma"  # H % 256: the mma tiles
    assert mp.MoEPrefill(dev, "bfloat16", impl="wgmma").gemm_impl(2048, 512) == "wgmma"  # type: ignore[arg-type]
    assert ("moe_wgmma.cu", "sm_90a") in loads
    assert ("moe_gemm.cu", "sm_90") in loads  # routing + the fallback: the same build as before
    assert mp.MoEPrefill(dev, "bfloat16", impl="wgmma128").gemm_impl(128, 128) == "wgmma128"  # type: ignore[arg-type]
    assert mp.MoEPrefill(dev, "bfloat16", impl="mma").impl == "mma"  # type: ignore[arg-type]
    loads.clear()
    ws = mp.MoEPrefill(dev, "bfloat16", impl="wgmma_ws")  # type: ignore[arg-type]
    assert ws.impl == ws.gemm_impl(2048, 512) == "wgmma_ws" and ws.gemm_impl(128, 128) == "mma"
    assert ("moe_wgmma_ws.cu", "sm_90a") in loads
    loads.clear()
    assert mp.MoEPrefill(_FakeDevice((8, 0)), "bfloat16").impl == "mma"  # type: ignore[arg-type]
    assert not [ld for ld in loads if ld[1] == "sm_90a"]
    assert mp.MoEPrefill(_FakeDevice((10, 0)), "bfloat16").impl == "mma"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"9\.0"):
        mp.MoEPrefill(_FakeDevice((8, 9)), "bfloat16", impl="wgmma")  # type: ignore[arg-type]

    def failing_load(src: str, options: tuple[str, ...], arch: str) -> _FakeModule:
        if src in ("moe_wgmma.cu", "moe_wgmma_ws.cu"):
            raise RuntimeError("no wgmma today")
        return _FakeModule()

    monkeypatch.setattr(mp, "load_module", failing_load)
    m = mp.MoEPrefill(dev, "bfloat16")  # type: ignore[arg-type]
    assert m.impl == "mma" and m.gemm_impl(2048, 512) == "mma"
    with pytest.raises(RuntimeError, match="no wgmma"):
        mp.MoEPrefill(dev, "bfloat16", impl="wgmma")  # type: ignore[arg-type]
    monkeypatch.setattr(mp, "load_module", fake_load)
    monkeypatch.setattr(mp, "AUTO_IMPL", "mma")
    assert mp.MoEPrefill(dev, "bfloat16").impl == "mma"  # type: ignore[arg-type]


def test_the_64_row_build_cuts_64_row_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """"wgmma64" (compiled with -DWG_BM=64) cuts 64-row tiles; auto and every other build 128-row ones; the
    tile-list buffer holds the 64-row build's tile count for any step."""
    import hybrid_runtime.cuda.moe_prefill as mp

    loads: list[tuple[str, ...]] = []

    def fake_load(src: str, options: tuple[str, ...], arch: str) -> _FakeModule:
        loads.append(options)
        return _FakeModule()

    monkeypatch.setattr(mp, "load_module", fake_load)
    dev = _FakeDevice((9, 0))
    for impl in ("auto", "wgmma", "wgmma_ws", "wgmma128", "mma"):
        assert mp.MoEPrefill(dev, "bfloat16", impl=impl).tile_rows == 128, impl  # type: ignore[arg-type]
    assert not any("-DWG_BM=64" in o for o in loads)
    w64 = mp.MoEPrefill(dev, "bfloat16", impl="wgmma64")  # type: ignore[arg-type]
    assert w64.impl == w64.gemm_impl(2048, 512) == "wgmma64" and w64.tile_rows == SMALL_BM == 64
    assert any("-DWG_BM=64" in o for o in loads)
    assert mp.MoEPrefill(_FakeDevice((8, 0)), "bfloat16").tile_rows == 128  # type: ignore[arg-type]
    E = 256
    assert mp.tile_list_words(8192 * 8, E) == 4 + 4 * mp.max_tiles(8192 * 8, E, 64) >= 4 + 4 * mp.max_tiles(
        8192 * 8, E)


def test_ws_persistent_items_cover_every_tile_and_column_block_once() -> None:
    for n_tiles, nx, grid in [(1, 4, 4), (3, 8, 132), (770, 4, 132), (770, 8, 132), (5, 4, 7), (0, 4, 3)]:
        seen = [it for cta in ws_items(n_tiles, nx, grid) for it in cta]
        assert sorted(seen) == [(t, x) for t in range(n_tiles) for x in range(nx)]


@pytest.mark.parametrize("kts", [[1], [2], [8, 8, 8], [32, 32], [1, 1, 1, 1, 1], [3, 5, 2], [8] * 6])
@pytest.mark.parametrize("seed", range(6))
def test_ws_protocol_is_safe_and_deadlock_free(kts: list[int], seed: int) -> None:
    """The mbarrier ring of the warp-specialised build under random interleavings (and random landing of the
    cp.async groups): data ready before every MMA, no stage overwritten under an MMA, arrivals in phase, no
    deadlock - for the build's (stages, lag) and the tighter legal lags, with the epilogue staged in the item's
    last stage (the default for bf16 / fp16 outputs) or stored straight from the accumulators (float32 slots,
    ``-DWS_STAGED_EPI=0``)."""
    ws = WGMMA_VARIANTS["wgmma_ws"]
    for stages, lag in {(ws.stages, ws.lag), (4, 1), (3, 1)}:
        for staged in (False, True):
            assert ws_protocol_sim(kts, stages, lag, seed=seed, staged=staged) > 0


def test_ws_protocol_sim_catches_a_deadlock() -> None:
    """lag = stages - 1 breaks the ring (the consumers wait for a stage the producer signals only after one it
    cannot start): the simulation must say so, or it proves nothing."""
    with pytest.raises(AssertionError, match="deadlock"):
        ws_protocol_sim([8, 8], 4, 3, seed=0)


@pytest.mark.parametrize("rows", [1, 64, 100, 128])
def test_ws_cta_model_matches_numpy(rows: int) -> None:
    """Persistent CTAs of each GEMM of the warp-specialised build (gate_up K = 256, down K = 128; two tiles of
    one expert and one of another, several CTAs over the work items) == numpy on the same gathered rows."""
    rng = np.random.default_rng(rows + 7)
    H, I, kk, ny, E, n = 512, 256, 4, 5, 3, 96
    ldh = H + 64
    h = rng.standard_normal((n, ldh))
    gu = rng.standard_normal((E, 2 * I, H))
    dn = rng.standard_normal((E, H, I))
    perm = rng.permutation(n * kk)
    r2 = min(rows, 128)
    pairs_t = [perm[:128], perm[128:128 + r2], perm[256:256 + rows]]  # tiles: (2, 128 rows), (2, r2), (0, rows)
    pair_list = np.concatenate([rng.integers(0, n * kk, 3), *pairs_t, rng.integers(0, n * kk, 3)])
    tl = [(2, 3, 128), (2, 3 + 128, r2), (0, 3 + 128 + r2, rows)]
    pair_w = rng.random(n * kk)
    done = np.concatenate(pairs_t)
    for staged in (False, True):  # straight from the accumulators, or through shared memory (WS_STAGED_EPI)
        act = np.full(n * kk * I, np.nan)
        for items in ws_items(len(tl), I // 128, 5):
            ws_cta_model("gate_up", h.ravel(), ldh, gu.ravel(), H, I, H, kk, ny, tl, pair_list, None, items, act,
                         staged=staged)
        act = act.reshape(n * kk, I)
        for (e, _, _), pairs in zip(tl, pairs_t, strict=True):
            x = h[pairs // kk, :H] @ gu[e].T
            np.testing.assert_allclose(act[pairs], x[:, :I] / (1 + np.exp(-x[:, :I])) * x[:, I:], rtol=1e-10,
                                       atol=1e-10)
        assert np.isnan(act[np.setdiff1d(np.arange(n * kk), done)]).all()
    a_in = rng.standard_normal((n * kk, I))
    for staged, y_in_t in ((False, True), (True, True), (True, False)):  # direct, down_t staged, float32 direct
        y = np.full(n * ny * H, np.nan)
        for items in ws_items(len(tl), H // 256, 3):
            ws_cta_model("down", a_in.ravel(), I, dn.ravel(), I, I, H, kk, ny, tl, pair_list, pair_w, items, y,
                         staged=staged, y_in_t=y_in_t)
        y = y.reshape(n, ny, H)
        for (e, _, _), pairs in zip(tl, pairs_t, strict=True):
            np.testing.assert_allclose(y[pairs // kk, pairs % kk], pair_w[pairs, None] * (a_in[pairs] @ dn[e].T),
                                       rtol=1e-10, atol=1e-10)
        written = np.zeros((n, ny), bool)
        written[done // kk, done % kk] = True
        assert np.isnan(y[~written]).all()


def test_experts_launches_the_gemms_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MoEPrefill.experts(gemms=...)``: both GEMMs in order (gate_up, then down), or only the one asked for
    (the benchmark times them apart), on the wgmma_ws build and the mma fallback; anything else is refused before
    a launch."""
    import types

    import hybrid_runtime.cuda.moe_prefill as mp
    from hybrid_runtime.cuda.moe_prefill import MoEBuffers

    launched: list[str] = []

    class RecKernel(_FakeKernel):
        def __init__(self, name: str) -> None:
            self.name = name

        def launch(self, *args: object, **kw: object) -> None:
            launched.append(self.name)

    class RecModule:
        def kernel(self, name: str) -> RecKernel:
            return RecKernel(name)

    monkeypatch.setattr(mp, "load_module", lambda src, options, arch: RecModule())
    dev = _FakeDevice((9, 0))
    dev.limits = types.SimpleNamespace(sm_count=132)  # type: ignore[attr-defined]
    bufs = MoEBuffers(*range(1, 10), 1000)
    for impl, gu, dn in (("wgmma_ws", "moe_wgmma_gate_up", "moe_wgmma_down_t"),
                         ("mma", "moe_gemm_gate_up", "moe_gemm_down_t")):
        moe = mp.MoEPrefill(dev, "bfloat16", impl=impl)  # type: ignore[arg-type]
        for gemms, want in (("both", [gu, dn]), ("gate_up", [gu]), ("down", [dn])):
            launched.clear()
            moe.experts(64, 1, 2048, 2, 3, 2048, 512, 8, 9, 256, bufs, y_dtype="bfloat16", gemms=gemms)
            assert launched == want, (impl, gemms, launched)
        launched.clear()
        with pytest.raises(ValueError, match="gemms"):
            moe.experts(64, 1, 2048, 2, 3, 2048, 512, 8, 9, 256, bufs, y_dtype="bfloat16", gemms="up")
        assert launched == []


@pytest.mark.parametrize("bits", sorted(PACKED_VARIANTS))
@pytest.mark.parametrize("dt", [1, 2])
def test_packed_builds_compile_for_sm90a_without_spills(bits: int, dt: int) -> None:
    """The packed-experts builds (-DWS_NBITS): the moe_wgmma_nb_* entry points only, no spills or serialised wgmma,
    registers for 384 threads, the stages + staging ring within the opt-in shared memory."""
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source

    v = PACKED_VARIANTS[bits]
    assert v.persistent and v.nbits == bits and f"-DWS_NBITS={bits}" in v.options
    log = compile_log(source(v.source), v.source, (f"-DDT={dt}", *v.options), WGMMA_ARCH)
    check_log(log)
    for name in ("moe_wgmma_nb_gate_up", "moe_wgmma_nb_down", "moe_wgmma_nb_down_t"):
        assert f"'{name}'" in log, log
    assert "'moe_wgmma_gate_up'" not in log  # the T-weight entry points are not in the packed module
    assert "wgmma.mma_async instructions are serialized" not in log, log
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", log)]
    static = max(int(m) for m in re.findall(r"(\d+) bytes smem", log))
    assert max(regs) * v.threads <= 65536, log
    staging = (v.lag + 1) * 128 * bits * 24  # slots x chunks x (16 code bytes + scale + zero-point)
    assert v.smem == v.stages * (128 + 256) * 128 + staging + 1024 and static + v.smem <= 227 * 1024, log
    assert 1 <= v.lag <= v.stages - 2


def test_zero_points_i32_reads_the_packed_layout() -> None:
    """zero_points_i32 against this test's own reading: 4-bit two a byte, low nibble first, rows padded to whole
    bytes (an odd block count leaves the last high nibble unused); 8-bit one a byte."""
    rng = np.random.default_rng(0)
    for bits, nb in ((4, 4), (4, 3), (8, 5)):
        E, R = 3, 7
        width = (nb + 1) // 2 if bits == 4 else nb
        zp = rng.integers(0, 256, (E, R * width), dtype=np.uint8)
        got = zero_points_i32(zp, E, R, nb, bits)
        assert got.dtype == np.int32 and got.shape == (E, R * nb)
        for e in range(E):
            for r in range(R):
                for b in range(nb):
                    byte = int(zp[e, r * width + (b // 2 if bits == 4 else b)])
                    want = ((byte >> 4) if b % 2 else (byte & 15)) if bits == 4 else byte
                    assert got[e, r * nb + b] == want, (bits, nb, e, r, b)
    with pytest.raises(ValueError, match="2-bit"):
        zero_points_i32(zp, 1, 1, 1, 2)


def test_packed_problems_name_what_the_packed_gemms_do_not_take() -> None:
    """MoEPrefill.packed_problems on the host (no GPU: the device is a stand-in with a compute capability)."""
    from types import SimpleNamespace

    from hybrid_runtime.cuda.driver import DeviceArray
    from hybrid_runtime.cuda.quant import PackedLinear

    def stack(N: int, K: int, bits: int = 4, bs: int = 128, zp: bool = False, perm: bool = False) -> PackedLinear:
        a = DeviceArray(0, (1,), "uint8", 0)
        return PackedLinear(a, a, a if zp else None, a if perm else None, K, N, bits, bs, K, 257)

    def prefill(cc: tuple[int, int], variant: str = "wgmma_ws") -> MoEPrefill:
        mp = MoEPrefill.__new__(MoEPrefill)
        mp.device = SimpleNamespace(compute_capability=cc)
        mp.variant = WGMMA_VARIANTS[variant]
        return mp

    H, I_ = 2048, 512
    ok = prefill((9, 0))
    assert ok.packed_problems(stack(2 * I_, H), stack(H, I_), H, I_, 257) == []
    assert ok.packed_problems(stack(2 * I_, H, 8, 32), stack(H, I_, 8, 16), H, I_, 257) == []
    cases = {"Hopper": (prefill((8, 0)), stack(2 * I_, H), stack(H, I_)),
             "64 rows": (prefill((9, 0), "wgmma64"), stack(2 * I_, H), stack(H, I_)),
             "act order": (ok, stack(2 * I_, H, perm=True), stack(H, I_)),
             "block size 16": (ok, stack(2 * I_, H, bs=16), stack(H, I_)),
             "3-bit": (ok, stack(2 * I_, H, bits=3), stack(H, I_)),
             "int32 copy": (ok, stack(2 * I_, H), stack(H, I_, zp=True)),
             "is not a": (ok, stack(I_, H), stack(H, I_))}
    for why, (mp, gu, dn) in cases.items():
        assert any(why in p for p in mp.packed_problems(gu, dn, H, I_, 257)), why
    assert any("whole tiles" in p for p in ok.packed_problems(stack(128, 128), stack(128, 64), 128, 64, 257))
