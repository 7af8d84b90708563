"""The dense decode GEMM (``ops/cuda/dense_decode.cu``, ``cuda/dense_decode.py``) on any machine: NVRTC compiles
both entry points for sm_90 in bf16 and fp16 for every knob set the benchmark offers, without spills; the host's
rules (shapes, knobs, warps, grids) and the backend's choice of it; and a lane-by-lane numpy model of the kernel's
register-direct fragments (16-byte loads paired with mma.sync m16n8k16's A / B / D layouts, split K over warps,
clamped rows past N, zero columns past n) == plain numpy."""

from __future__ import annotations

import numpy as np
import pytest
from test_cuda_compile import check_log, nvrtc_or_skip
from test_cuda_compile import ptx as compute_90_ptx

from hybrid_runtime.cuda.dense_decode import (
    DEFAULT_KNOBS,
    KNOB_SETS,
    MAX_ROWS,
    SOURCE,
    DenseKnobs,
    check,
    grid,
    pick,
    problems,
    warps_for,
)


@pytest.mark.parametrize("name", sorted(KNOB_SETS))
@pytest.mark.parametrize("dt", [1, 2])
def test_dense_decode_compiles_for_sm90_without_spills(dt: int, name: str) -> None:
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source

    log = compile_log(source(SOURCE), SOURCE, (f"-DDT={dt}", *KNOB_SETS[name].options), "sm_90")
    check_log(log)
    assert "dd_gemm_m16" in log and "dd_gemm_m32" in log, log


@pytest.mark.parametrize("sync", [1, 2])
def test_the_benchmarks_synchronisation_builds_compile(sync: int) -> None:
    """``DD_SYNC`` 1 (no wait) and 2 (a counter in global memory), which only ``benchmarks.gpu_kernel_boundary``
    builds: they compile without spills, and the counter build's kernels take the two extra parameters (its PTX
    spins with an acquire load and releases with a red.release)."""
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source

    opts = ("-DDT=2", *DEFAULT_KNOBS.options, f"-DDD_SYNC={sync}")
    check_log(compile_log(source(SOURCE), SOURCE, opts, "sm_90"))
    ptx = compute_90_ptx(source(SOURCE), SOURCE, opts)
    assert "griddepcontrol.wait" not in ptx and "griddepcontrol.launch_dependents" in ptx
    assert ("ld.acquire.gpu" in ptx) == (sync == 2) and ("red.release.gpu" in ptx) == (sync == 2)
    assert ("dd_gemm_m16_param_13" in ptx) == (sync == 2)
    default = compute_90_ptx(source(SOURCE), SOURCE, ("-DDT=2", *DEFAULT_KNOBS.options))
    assert "griddepcontrol.wait" in default and "dd_gemm_m16_param_12" not in default


def test_the_early_trigger_build_launches_dependents_before_it_waits() -> None:
    """``DD_TRIGGER=1`` (benchmarks.gpu_kernel_boundary): griddepcontrol.launch_dependents once, before the
    pre-wait weight loads and before griddepcontrol.wait, which stays."""
    nvrtc_or_skip()
    from hybrid_runtime.cuda.kernels import compile_log, source

    opts = ("-DDT=2", *DEFAULT_KNOBS.options, "-DDD_TRIGGER=1")
    check_log(compile_log(source(SOURCE), SOURCE, opts, "sm_90"))
    body = compute_90_ptx(source(SOURCE), SOURCE, opts).split(".entry dd_gemm_m16")[1].split(".entry")[0]
    assert body.count("griddepcontrol.launch_dependents") == 1 and body.count("griddepcontrol.wait") == 1
    assert body.index("griddepcontrol.launch_dependents") < body.index("ld.global.nc") < body.index(
        "griddepcontrol.wait")


def test_the_instruction_cache_evictor_is_one_long_straight_run() -> None:
    """``icache_evict.cu`` (cold-code timing, benchmarks.gpu_common.cold_graph_seconds): NVRTC compiles it for
    sm_90, and its SASS is one straight run (no branch among them) of >= 4096 FFMA: 64 KB of code."""
    nvrtc_or_skip()
    from benchmarks.gpu_common import EVICT_SOURCE
    from hybrid_runtime.cuda.kernels import compile_cubin, compile_log, source

    check_log(compile_log(source(EVICT_SOURCE), EVICT_SOURCE, (), "sm_90"))
    cubin = compile_cubin(source(EVICT_SOURCE), EVICT_SOURCE, (), "sm_90")
    assert len(cubin) > 64 * 1024
    from benchmarks.sass_loops import nvdisasm_path

    tool = nvdisasm_path()
    if tool is None:
        return
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout
    assert sass.count("FFMA") >= 4096 and sass.rfind("FFMA") < sass.find("BRA")  # no branch among them


def test_knobs_and_host_rules() -> None:
    assert DEFAULT_KNOBS.kernel == "dd_gemm_m16" and KNOB_SETS["m32"].kernel == "dd_gemm_m32"
    for bad in ({"u": 0}, {"u": 9}, {"pf": 65}, {"rows": 24}, {"k_per_warp": 100}):
        with pytest.raises(ValueError, match="dense_decode knobs"):
            DenseKnobs(**bad)
    assert warps_for(2048) == 4 and warps_for(4096) == 8 and warps_for(96) == 1 and warps_for(1 << 16) == 8
    assert warps_for(2048, DenseKnobs(k_per_warp=256)) == 8
    assert grid(12352) == (772, 1, 1) and grid(264) == (17, 1, 1) and grid(264, KNOB_SETS["m32"]) == (9, 1, 1)
    assert problems("bfloat16", 16, 12352, 2048, 2056, 256, 512) == []
    assert problems("float32", 1, 64, 64, 64) and problems("bfloat16", MAX_ROWS + 1, 64, 64, 64)
    assert problems("float16", 1, 64, 48, 64) and problems("float16", 1, 64, 64, 60)
    assert problems("float16", 1, 64, 64, 64, x_ptr=8)
    with pytest.raises(ValueError, match=r"n 0 not in 1\.\.16.*K 40"):
        check("bfloat16", 0, 64, 40, 64)


def test_pick_keeps_the_primary_unless_another_build_is_faster() -> None:
    a, b, c = DEFAULT_KNOBS, KNOB_SETS["u2"], KNOB_SETS["m32"]
    assert pick({a: 2.0, b: 1.0, c: 3.0}, a) == b
    assert pick({a: 1.0, b: 1.0}, a) == a and pick({}, a) == a and pick({b: 1.0}, a) == b


def mma16816(a: list[np.ndarray], b: list[np.ndarray]) -> np.ndarray:
    """D (16 x 8) of one mma.sync m16n8k16 from the 32 lanes' fragments (PTX ISA layouts): lane (g, t) holds
    a0 = A[g, 2t:2t+2], a1 = A[g+8, 2t:2t+2], a2 = A[g, 2t+8:2t+10], a3 = A[g+8, 2t+8:2t+10] and
    b0 = B[2t:2t+2, g], b1 = B[2t+8:2t+10, g]."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a0, a1, a2, a3 = a[lane]
        b0, b1 = b[lane]
        A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = a0, a1
        A[g, 2 * t + 8:2 * t + 10], A[g + 8, 2 * t + 8:2 * t + 10] = a2, a3
        B[2 * t:2 * t + 2, g], B[2 * t + 8:2 * t + 10, g] = b0, b1
    return A @ B


def cta_model(W: np.ndarray, X: np.ndarray, n: int, row0: int, mt_count: int, nw: int) -> np.ndarray:
    """out rows [row0, row0 + 16 mt_count) x tokens [0, 16) of one CTA as dense_decode.cu computes them (NaN where
    it writes nothing): the lanes' 16-byte loads as mma fragments, warps over split K, the sums in warp order."""
    N, K = W.shape
    S = K // 32
    out = np.full((16 * mt_count, 16), np.nan)
    ng = (n + 7) // 8
    red = np.zeros((nw, mt_count, 2, 16, 8))
    for w in range(nw):
        s0, s1 = S * w // nw, S * (w + 1) // nw
        for mt in range(mt_count):
            for q in range(ng):
                for s in range(s0, s1):
                    a0, a1, b0, b1 = [], [], [], []
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        k = 32 * s + 8 * t
                        lo = W[min(row0 + 16 * mt + g, N - 1), k:k + 8]  # rows past N: clamped
                        hi = W[min(row0 + 16 * mt + g + 8, N - 1), k:k + 8]
                        j = 8 * q + g
                        xv = X[j, k:k + 8] if j < n else np.zeros(8)
                        # step 0: words x, y (k + 0..3); step 1: words z, w (k + 4..7)
                        a0.append((lo[0:2], hi[0:2], lo[2:4], hi[2:4]))
                        b0.append((xv[0:2], xv[2:4]))
                        a1.append((lo[4:6], hi[4:6], lo[6:8], hi[6:8]))
                        b1.append((xv[4:6], xv[6:8]))
                    red[w, mt, q] += mma16816(a0, b0) + mma16816(a1, b1)
    tot = red.sum(0)
    for mt in range(mt_count):
        for q in range(ng):
            for r in range(16):
                for c in range(8):
                    j, row = 8 * q + c, row0 + 16 * mt + r
                    if j < n and row < N:
                        out[16 * mt + r, j] = tot[mt, q, r, c]
    return out


@pytest.mark.parametrize("N, K, n, mt_count, nw", [(16, 64, 1, 1, 1), (40, 96, 9, 1, 2), (40, 128, 16, 2, 3),
                                                   (20, 256, 7, 2, 8)])
def test_the_lanes_fragments_compute_the_product(N: int, K: int, n: int, mt_count: int, nw: int) -> None:
    rng = np.random.default_rng(N + K + n)
    W = rng.standard_normal((N, K))
    X = rng.standard_normal((16, K))
    want = W @ X.T  # [N, 16]
    rows = 16 * mt_count
    for row0 in range(0, N, rows):
        got = cta_model(W, X, n, row0, mt_count, nw)
        r1 = min(N, row0 + rows)
        np.testing.assert_allclose(got[:r1 - row0, :n], want[row0:r1, :n], rtol=1e-12, atol=1e-12)
        assert np.isnan(got[:, n:]).all() and np.isnan(got[r1 - row0:]).all()
