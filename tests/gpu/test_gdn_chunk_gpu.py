"""Chunked GDN prefill (ops/cuda/gdn_chunk.cu) on the GPU: against the token-scan kernel (gdn_prefill) and
against the float64 token recurrence, outputs and final states, from non-zero initial states, with GQA
(nv = 2 nk), lengths around the 64-token chunk, long prompts and a packed varlen batch; the builds
(precision "fp32": float32 SIMT, "tf32": tensor cores with the (I + A)^-1 prep and 64-column state CTAs,
"tf32_v2": the same with 32-column state CTAs, "tf32_v1": the first tensor-core build, forward
substitution, and "bf16": the state pass split in two on bf16 tensor cores), "tf32" against "tf32_v2" (same
numerics), and the batch invariance of each (a prompt alone == in a batch, whole == cut at a multiple of 64, bit for
bit)."""

from __future__ import annotations

import numpy as np
import pytest
from gdn_cases import Shape, rel

from hybrid_runtime.ops import gdn as ref

pytestmark = pytest.mark.gpu

TOL = 5e-5  # float32 kernels vs float64 (relative, Frobenius norm)
# tf32 build vs float64: the numpy model of its operand rounding (tests/unit/test_gdn_chunk_math.py
# test_tf32_operands_stay_near_float64) gives ~4e-4 at dk = dv = 128; 2.5e-3 leaves room for float32 sums
TF32_TOL = 2.5e-3
# bf16 build vs float64: W, Aqk, q, k, V, S and sk V rounded to bf16 (8-bit significand) as tensor-core operands,
# float32 accumulators and state; the numpy model (test_gdn_chunk_math.py test_bf16_split_build_stays_near_float64)
# gives ~2.4e-3 at dk = dv = 128, the H200 2.2e-3 / 2.3e-3 (o / state)
BF16_TOL = 6e-3


def tol_of(precision: str) -> float:
    return {"fp32": TOL, "bf16": BF16_TOL}.get(precision, TF32_TOL)


@pytest.fixture(scope="module")
def dev():
    import torch

    torch.cuda.init()
    from hybrid_runtime.cuda.driver import CudaDevice

    return CudaDevice(0)


def reference64(conv0: np.ndarray, rec0: np.ndarray, u: np.ndarray, g: np.ndarray, beta: np.ndarray,
                w: np.ndarray, sh: Shape, lens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """float32 conv (as ops.gdn), then the delta rule token by token in float64. conv0 ``[S, K-1, C]`` and
    rec0 ``[S, nv, dk, dv]`` are the sequences' initial states. Returns (o ``[N, nv*dv]``, states)."""
    outs, states, at = [], [], 0
    for s, n in enumerate(lens):
        x, _ = ref.causal_conv_prefill(conv0[s], u[at:at + n], w)
        q, k, v = (a.astype(np.float64) for a in ref._split_heads(x, sh.nk, sh.dk, sh.nv, sh.dv))
        S = rec0[s:s + 1].astype(np.float64)
        o = np.empty((n, sh.nv, sh.dv))
        for t in range(n):
            ot, S = ref.delta_rule_step(S, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[at + t:at + t + 1].astype(np.float64),
                                        beta[at + t:at + t + 1].astype(np.float64))
            o[t] = ot[0]
        outs.append(o.reshape(n, -1))
        states.append(S[0])
        at += n
    return np.concatenate(outs), np.stack(states)


def run_both(dev, sh: Shape, lens: list[int], seed: int, ref64: bool = True, precision: str = "fp32",
             runs: str | None = None) -> None:
    """Scan and chunked (``precision`` build; ``runs``: the build it falls back to, default itself) from the
    same states; the chunked vs the scan and, with ``ref64``, both vs the float64 recurrence (per sequence
    too)."""
    from hybrid_runtime.cuda.gdn import CudaGdn
    from hybrid_runtime.cuda.state import DeviceStateCache
    from hybrid_runtime.state_cache import StateLayout

    S = len(lens)
    rng = np.random.default_rng(seed)
    layout = StateLayout(2 * S + 1, (sh.K - 1, sh.C), (sh.nv, sh.dk, sh.dv))
    cache = DeviceStateCache(dev, layout, layers=[0])
    conv_np, rec_np = layout.allocate()
    conv0 = rng.standard_normal((S, sh.K - 1, sh.C)).astype(np.float32)
    rec0 = (0.1 * rng.standard_normal((S, sh.nv, sh.dk, sh.dv))).astype(np.float32)
    scan_slots, chunk_slots = list(range(0, 2 * S, 2)), list(range(2 * S - 1, 0, -2))  # distinct, any order
    conv_np[scan_slots], rec_np[scan_slots] = conv0, rec0
    conv_np[chunk_slots], rec_np[chunk_slots] = conv0, rec0
    cache.upload_layer(0, conv_np, rec_np)
    gdn = CudaGdn(dev, layout, sh.nk, "float32", precision=precision)
    assert gdn.chunk_module is not None and gdn.precision == (runs or precision)
    tol = tol_of(runs or precision)
    N = sum(lens)
    u = rng.standard_normal((N, sh.C)).astype(np.float32)
    g = (-np.abs(rng.standard_normal((N, sh.nv))) * 0.5).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((N, sh.nv))))).astype(np.float32)
    w = (0.5 * rng.standard_normal((sh.C, sh.K))).astype(np.float32)
    ud, gd, bd, wd = (dev.upload(a) for a in (u, g, beta, w))
    conv, rec = cache.conv[0], cache.recurrent[0]
    o_scan = dev.download(gdn.prefill(conv, rec, scan_slots, lens, ud, gd, bd, wd, mode="scan"))
    o_chunk = dev.download(gdn.prefill(conv, rec, chunk_slots, lens, ud, gd, bd, wd, mode="chunked"))
    conv_d, rec_d = cache.download_layer(0)
    assert np.isfinite(o_chunk).all() and np.isfinite(rec_d[chunk_slots]).all()
    vs_scan = tol if precision != "fp32" else 1e-4
    assert rel(o_chunk, o_scan) < vs_scan
    assert rel(rec_d[chunk_slots], rec_d[scan_slots]) < vs_scan
    assert np.array_equal(conv_d[chunk_slots], conv_d[scan_slots])  # the conv path is shared
    sink = layout.sink
    assert not rec_d[sink].any() and not conv_d[sink].any()  # nobody wrote the sink
    if ref64:
        o_ref, S_ref = reference64(conv0, rec0, u, g, beta, w, sh, lens)
        print(f"{precision} {lens[:4]}: o {rel(o_chunk, o_ref):.2e}, state {rel(rec_d[chunk_slots], S_ref):.2e}")
        assert rel(o_chunk, o_ref) < tol and rel(o_scan, o_ref) < TOL
        assert rel(rec_d[chunk_slots], S_ref) < tol and rel(rec_d[scan_slots], S_ref) < TOL
        for s, n in enumerate(lens):  # every sequence on its own, not only the batch norm
            at = sum(lens[:s])
            assert rel(o_chunk[at:at + n], o_ref[at:at + n]) < (4 if precision != "fp32" else 10) * tol, (s, n)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
def test_single_sequence_qwen35_shape(dev, T: int) -> None:
    """16 key heads, 32 value heads, dk = dv = 128 (Qwen3.5-35B-A3B)."""
    run_both(dev, Shape(nk=16, nv=32, dk=128, dv=128, K=4), [T], seed=T)


def test_long_prompt(dev) -> None:
    """8192 tokens (128 chunks of sequential state passing), dk = dv = 128, nv = 2 nk."""
    run_both(dev, Shape(nk=2, nv=4, dk=128, dv=128, K=4), [8192], seed=8192)


def test_varlen_batch(dev) -> None:
    run_both(dev, Shape(nk=4, nv=8, dk=128, dv=128, K=4), [65, 1, 700, 64, 129, 3, 2000], seed=17)


@pytest.mark.parametrize("dims", [(2, 4, 64, 32), (1, 2, 20, 12), (2, 4, 16, 48)])
def test_other_head_dims(dev, dims: tuple[int, int, int, int]) -> None:
    """dv not a multiple of 32 (masked columns), dk not a multiple of 32 (idle warps in step c)."""
    nk, nv, dk, dv = dims
    run_both(dev, Shape(nk=nk, nv=nv, dk=dk, dv=dv, K=4), [1, 100, 64, 257], seed=dk + dv)


def test_qwen35_batch_8x4096_against_scan(dev) -> None:
    """The benchmark's batched shape, chunked vs scan only (the float64 reference would take minutes)."""
    run_both(dev, Shape(nk=16, nv=32, dk=128, dv=128, K=4), [4096] * 8, seed=4096, ref64=False)


# ------------------------------------------------------------------------- tensor-core builds: tf32 and bf16


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
def test_tc_single_sequence_qwen35_shape(dev, T: int, precision: str) -> None:
    run_both(dev, Shape(nk=16, nv=32, dk=128, dv=128, K=4), [T], seed=T, precision=precision)


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_tc_long_prompt(dev, precision: str) -> None:
    """8192 tokens: 128 chunks of state carried through tf32 / bf16 operands (the float32 state must not drift)."""
    run_both(dev, Shape(nk=2, nv=4, dk=128, dv=128, K=4), [8192], seed=8192, precision=precision)


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_tc_varlen_batch(dev, precision: str) -> None:
    run_both(dev, Shape(nk=4, nv=8, dk=128, dv=128, K=4), [65, 1, 700, 64, 129, 3, 2000], seed=17,
             precision=precision)


@pytest.mark.parametrize("dims", [(2, 4, 64, 32), (1, 2, 16, 12), (2, 4, 16, 48), (1, 2, 192, 64)])
@pytest.mark.parametrize("precision", ["tf32", "tf32_v2"])
def test_tf32_other_head_dims(dev, dims: tuple[int, int, int, int], precision: str) -> None:
    """dv not a multiple of 32 / 64 (masked columns), dk = 16 / 64 (idle warps in step c), dk = 192 (two state
    tiles per warp; 227 KB of shared memory: "tf32" needs 274 KB there and runs "tf32_v2")."""
    nk, nv, dk, dv = dims
    runs = "tf32_v2" if dk == 192 else precision
    run_both(dev, Shape(nk=nk, nv=nv, dk=dk, dv=dv, K=4), [1, 100, 64, 257], seed=dk + dv, precision=precision,
             runs=runs)


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_tc_qwen35_batch_8x4096_against_scan(dev, precision: str) -> None:
    run_both(dev, Shape(nk=16, nv=32, dk=128, dv=128, K=4), [4096] * 8, seed=4096, ref64=False, precision=precision)


@pytest.mark.parametrize("lens", [[1000], [65, 1, 700, 64, 129, 3, 2000]])
@pytest.mark.parametrize("precision", ["tf32_v2", "tf32_v1"])
def test_tf32_previous_builds_still_right(dev, lens: list[int], precision: str) -> None:
    """The previous tensor-core builds (kept for benchmark comparison) stay correct."""
    run_both(dev, Shape(nk=4, nv=8, dk=128, dv=128, K=4), lens, seed=len(lens), precision=precision)


@pytest.mark.parametrize("dims", [(4, 8, 128, 128), (2, 4, 64, 32), (1, 2, 16, 12), (2, 4, 16, 48)])
def test_tf32_matches_tf32_v2(dev, dims: tuple[int, int, int, int]) -> None:
    """"tf32" (64-column state CTAs) rounds the same operands the same way as "tf32_v2" (32 columns) and keeps
    every accumulator's k order: outputs and states agree to float32 rounding (a fragment or column mistake
    would be O(1)); printed: whether they are bit-identical."""
    from hybrid_runtime.cuda.gdn import CudaGdn
    from hybrid_runtime.cuda.state import DeviceStateCache
    from hybrid_runtime.state_cache import StateLayout

    nk, nv, dk, dv = dims
    sh = Shape(nk=nk, nv=nv, dk=dk, dv=dv, K=4)
    lens = [65, 1, 700, 64, 129, 3, 1000]
    S, N = len(lens), sum(lens)
    rng = np.random.default_rng(dk + dv + 1)
    layout = StateLayout(2 * S, (sh.K - 1, sh.C), (sh.nv, sh.dk, sh.dv))
    cache = DeviceStateCache(dev, layout, layers=[0])
    conv_np, rec_np = layout.allocate()
    conv_np[:2 * S] = np.tile(rng.standard_normal((S, sh.K - 1, sh.C)).astype(np.float32), (2, 1, 1))
    rec_np[:2 * S] = np.tile((0.1 * rng.standard_normal((S, sh.nv, sh.dk, sh.dv))).astype(np.float32), (2, 1, 1, 1))
    cache.upload_layer(0, conv_np, rec_np)
    u = dev.upload(rng.standard_normal((N, sh.C)).astype(np.float32))
    g = dev.upload((-np.abs(rng.standard_normal((N, sh.nv))) * 0.5).astype(np.float32))
    beta = dev.upload((1 / (1 + np.exp(-rng.standard_normal((N, sh.nv))))).astype(np.float32))
    w = dev.upload((0.5 * rng.standard_normal((sh.C, sh.K))).astype(np.float32))
    conv, rec = cache.conv[0], cache.recurrent[0]
    outs = {}
    for p, slots in (("tf32", list(range(S))), ("tf32_v2", list(range(S, 2 * S)))):
        gdn = CudaGdn(dev, layout, sh.nk, "float32", precision=p)
        assert gdn.precision == p and gdn.chunk_cols == (64 if p == "tf32" else 32)
        gdn.narrow_below = 0  # "tf32": its own 64-column state pass, never the 32-column twin
        assert gdn.state_cols_for(S) == gdn.chunk_cols
        outs[p] = dev.download(gdn.prefill(conv, rec, slots, lens, u, g, beta, w, mode="chunked"))
    _, rec_d = cache.download_layer(0)
    print(f"{dims}: o {rel(outs['tf32'], outs['tf32_v2']):.1e} (identical: "
          f"{np.array_equal(outs['tf32'], outs['tf32_v2'])}), state {rel(rec_d[:S], rec_d[S:2 * S]):.1e}")
    assert np.isfinite(outs["tf32"]).all()
    # the same bits: CudaGdn.state_cols_for picks between the two per step, so batch invariance depends on it
    assert np.array_equal(outs["tf32"], outs["tf32_v2"]), rel(outs["tf32"], outs["tf32_v2"])
    assert np.array_equal(rec_d[:S], rec_d[S:2 * S]), rel(rec_d[:S], rec_d[S:2 * S])


def test_tf32_takes_the_32_column_state_pass_when_the_grid_is_small(dev) -> None:
    """Qwen3.5-35B-A3B's GDN (nv = 32, dv = 128): one sequence's 32-column grid, 128 CTAs, fits the H200's 132 SMs,
    so the "tf32" object runs the 32-column twin; more sequences keep the 64-column pass. Both give the bits of
    a "tf32" object held to its 64-column pass."""
    from hybrid_runtime.cuda.gdn import CudaGdn
    from hybrid_runtime.cuda.state import DeviceStateCache
    from hybrid_runtime.state_cache import StateLayout

    sh = Shape(nk=16, nv=32, dk=128, dv=128, K=4)
    layout = StateLayout(2, (sh.K - 1, sh.C), (sh.nv, sh.dk, sh.dv))
    auto = CudaGdn(dev, layout, sh.nk, "float32", precision="tf32")
    assert auto.narrow_module is not None and auto.narrow_below == dev.limits.sm_count
    assert auto.state_cols_for(1) == (32 if dev.limits.sm_count >= 128 else 64)
    assert auto.state_cols_for(dev.limits.sm_count // 128 + 1) == 64
    wide = CudaGdn(dev, layout, sh.nk, "float32", precision="tf32")
    wide.narrow_below = 0
    rng = np.random.default_rng(3)
    N = 700
    cache = DeviceStateCache(dev, layout, layers=[0])
    conv_np, rec_np = layout.allocate()
    conv_np[:2] = rng.standard_normal((1, sh.K - 1, sh.C)).astype(np.float32)
    rec_np[:2] = (0.1 * rng.standard_normal((1, sh.nv, sh.dk, sh.dv))).astype(np.float32)
    cache.upload_layer(0, conv_np, rec_np)
    u = dev.upload(rng.standard_normal((N, sh.C)).astype(np.float32))
    g = dev.upload((-np.abs(rng.standard_normal((N, sh.nv))) * 0.5).astype(np.float32))
    beta = dev.upload((1 / (1 + np.exp(-rng.standard_normal((N, sh.nv))))).astype(np.float32))
    w = dev.upload((0.5 * rng.standard_normal((sh.C, sh.K))).astype(np.float32))
    conv, rec = cache.conv[0], cache.recurrent[0]
    o_auto = dev.download(auto.prefill(conv, rec, [0], [N], u, g, beta, w, mode="chunked"))
    o_wide = dev.download(wide.prefill(conv, rec, [1], [N], u, g, beta, w, mode="chunked"))
    _, rec_d = cache.download_layer(0)
    assert np.isfinite(o_auto).all()
    assert np.array_equal(o_auto, o_wide) and np.array_equal(rec_d[0], rec_d[1])


# ---------------------------------------------------------------------------------------------- bf16 build


@pytest.mark.parametrize("dims", [(2, 4, 64, 32), (2, 4, 16, 96), (1, 2, 192, 64), (1, 2, 16, 12)])
def test_bf16_other_head_dims(dev, dims: tuple[int, int, int, int]) -> None:
    """dk = 64 / 16 (idle warps in the state update), dv = 96 (a CTA of masked columns), dk = 192 (two state tiles
    per warp); dv = 12 (not a multiple of 32) runs the "tf32" build."""
    nk, nv, dk, dv = dims
    runs = "tf32" if dv % 32 else "bf16"
    run_both(dev, Shape(nk=nk, nv=nv, dk=dk, dv=dv, K=4), [1, 100, 64, 257], seed=dk + dv, precision="bf16",
             runs=runs)


def test_tf32_falls_back_to_fp32_off_16(dev) -> None:
    from hybrid_runtime.cuda.gdn import CudaGdn
    from hybrid_runtime.state_cache import StateLayout

    sh = Shape(nk=1, nv=2, dk=20, dv=12, K=4)
    gdn = CudaGdn(dev, StateLayout(3, (sh.K - 1, sh.C), (sh.nv, sh.dk, sh.dv)), sh.nk, "float32", precision="tf32")
    assert gdn.precision == "fp32" and gdn.chunk_module is not None


@pytest.mark.parametrize("precision", ["fp32", "tf32", "tf32_v2", "tf32_v1", "bf16"])
def test_batch_and_cut_invariance(dev, precision: str) -> None:
    """The chunked path gives a prompt the same bits alone, in a packed batch with others, and cut at a
    multiple of 64 tokens (state and conv window through the slot): outputs and final state."""
    from hybrid_runtime.cuda.gdn import CudaGdn
    from hybrid_runtime.cuda.state import DeviceStateCache
    from hybrid_runtime.state_cache import StateLayout

    sh = Shape(nk=2, nv=4, dk=128, dv=128, K=4)
    rng = np.random.default_rng(5)
    layout = StateLayout(8, (sh.K - 1, sh.C), (sh.nv, sh.dk, sh.dv))
    cache = DeviceStateCache(dev, layout, layers=[0])
    conv_np, rec_np = layout.allocate()
    conv_np[:] = rng.standard_normal(conv_np.shape).astype(np.float32)
    rec_np[:] = (0.1 * rng.standard_normal(rec_np.shape)).astype(np.float32)
    conv_np[1:4], rec_np[1:4] = conv_np[0], rec_np[0]  # slots 0..3 start from the same state
    cache.upload_layer(0, conv_np, rec_np)
    conv, rec = cache.conv[0], cache.recurrent[0]
    gdn = CudaGdn(dev, layout, sh.nk, "float32", precision=precision)
    T = 200
    u = rng.standard_normal((T + 72, sh.C)).astype(np.float32)
    g = (-np.abs(rng.standard_normal((T + 72, sh.nv))) * 0.5).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((T + 72, sh.nv))))).astype(np.float32)
    w = dev.upload((0.5 * rng.standard_normal((sh.C, sh.K))).astype(np.float32))

    def run(slots: list[int], parts: list[np.ndarray]) -> np.ndarray:
        """Prefill the packed rows ``parts`` (index arrays into u/g/beta) as one step."""
        idx = np.concatenate(parts)
        ud, gd, bd = (dev.upload(np.ascontiguousarray(a[idx])) for a in (u, g, beta))
        return dev.download(gdn.prefill(conv, rec, slots, [len(p) for p in parts], ud, gd, bd, w))

    prompt = np.arange(T)
    alone = run([0], [prompt])
    mate_a, mate_b = np.arange(130, 130 + 65) % (T + 72), np.arange(5, 12)
    batched = run([5, 1, 6], [mate_a, prompt, mate_b])
    first, second = run([2], [prompt[:128]]), run([2], [prompt[128:]])
    _, rec_d = cache.download_layer(0)
    at = len(mate_a)
    assert np.array_equal(batched[at:at + T], alone)
    assert np.array_equal(np.concatenate([first, second]), alone)
    assert np.array_equal(rec_d[1], rec_d[0]) and np.array_equal(rec_d[2], rec_d[0])
