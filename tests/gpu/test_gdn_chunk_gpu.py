"""Chunked GDN prefill (ops/cuda/gdn_chunk.cu) on the GPU: against the token-scan kernel (gdn_prefill) and
against the float64 token recurrence, outputs and final states, from non-zero initial states, with GQA
(nv = 2 nk), lengths around the 64-token chunk, long prompts and a packed varlen batch."""

from __future__ import annotations

import numpy as np
import pytest
from gdn_cases import Shape, rel

from hybrid_runtime.ops import gdn as ref

pytestmark = pytest.mark.gpu

TOL = 5e-5  # float32 kernels vs float64 (relative, Frobenius norm)


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


def run_both(dev, sh: Shape, lens: list[int], seed: int, ref64: bool = True) -> None:
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
    gdn = CudaGdn(dev, layout, sh.nk, "float32")
    assert gdn.chunk_module is not None
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
    assert rel(o_chunk, o_scan) < 1e-4
    assert rel(rec_d[chunk_slots], rec_d[scan_slots]) < 1e-4
    assert np.array_equal(conv_d[chunk_slots], conv_d[scan_slots])  # the conv path is shared
    sink = layout.sink
    assert not rec_d[sink].any() and not conv_d[sink].any()  # nobody wrote the sink
    if ref64:
        o_ref, S_ref = reference64(conv0, rec0, u, g, beta, w, sh, lens)
        assert rel(o_chunk, o_ref) < TOL and rel(o_scan, o_ref) < TOL
        assert rel(rec_d[chunk_slots], S_ref) < TOL and rel(rec_d[scan_slots], S_ref) < TOL
        for s, n in enumerate(lens):  # every sequence on its own, not only the batch norm
            at = sum(lens[:s])
            assert rel(o_chunk[at:at + n], o_ref[at:at + n]) < 10 * TOL, (s, n)


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
