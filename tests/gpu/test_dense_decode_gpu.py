"""The dense decode GEMM (``cuda/dense_decode.py``, ``ops/cuda/dense_decode.cu``) on the GPU: against a float64
reference of the same bf16 / fp16 inputs for the Qwen3.5-35B-A3B decode projections (in_proj, qkv, out_proj,
lm_head-sized N), an N that 16 does not divide, 1 .. 16 rows, float32 and T outputs, bias, the residual added in
place (D = C); a row's bits the same alone and inside a 16-row step (batch invariance); nothing written past row
n or column N; every knob set of the benchmark."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_bits import host_bits, to_f32

pytestmark = pytest.mark.gpu

CANARY = -7777.0
SHAPES = [(12352, 2048), (2048, 4096), (264, 2048), (40, 96)]


class Rig:
    def __init__(self, dev, dtype: str, N: int, K: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.dev, self.dtype, self.N, self.K = dev, dtype, N, K
        self.ldx = K + 8  # a padded leading dimension, as the arena's
        self.wb = host_bits((rng.standard_normal((N, K)) * 0.05).astype(np.float32), dtype)
        self.xb = host_bits(rng.standard_normal((16, self.ldx)).astype(np.float32), dtype)
        self.w, self.x = dev.upload(self.wb, dtype=dtype), dev.upload(self.xb, dtype=dtype)
        self.bias = rng.standard_normal(N).astype(np.float32)
        self.res = rng.standard_normal((16, N + 4)).astype(np.float32)
        self.b = dev.upload(self.bias)
        self.ref = to_f32(self.xb, dtype)[:, :K].astype(np.float64) @ to_f32(self.wb, dtype).astype(np.float64).T

    def run(self, kern, n: int, out_f32: bool, bias: bool = False, residual: bool = False) -> np.ndarray:
        """out [16, N + 4] after one call on n rows (float32 or the dtype's bits); canaries elsewhere."""
        ldo = self.N + 4
        host = self.res.copy() if residual else np.full((16, ldo), CANARY, np.float32)
        if out_f32:
            out = self.dev.upload(host)
        else:
            out = self.dev.upload(host_bits(host, self.dtype), dtype=self.dtype)
        kern.launch(n, self.x.ptr, self.ldx, self.w.ptr, self.N, self.K, out.ptr, ldo, out_f32,
                    residual=out.ptr if residual else 0, ldr=ldo if residual else 0, bias=self.b.ptr if bias else 0)
        self.dev.synchronize()
        return self.dev.download(out)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference_and_is_batch_invariant(dev, dtype, shape) -> None:
    from hybrid_runtime.cuda.dense_decode import DenseDecode

    N, K = shape
    rig = Rig(dev, dtype, N, K)
    kern = DenseDecode(dev, dtype)
    alone = None
    for n in (16, 9, 8, 3, 1):
        got = rig.run(kern, n, out_f32=True)
        tol = 2e-4 * np.sqrt(K)  # float32 accumulation of K products of magnitude ~0.05
        np.testing.assert_allclose(got[:n, :N], rig.ref[:n], rtol=0, atol=tol)
        assert (got[n:] == CANARY).all() and (got[:, N:] == CANARY).all(), "wrote past row n or column N"
        if n == 16:
            alone = got
        else:  # the same bits as inside the 16-row step
            assert np.array_equal(got[:n, :N].view(np.uint32), alone[:n, :N].view(np.uint32)), n


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_bias_residual_in_place_and_dtype_output(dev, dtype) -> None:
    from hybrid_runtime.cuda.dense_decode import DenseDecode

    N, K = 264, 2048
    rig = Rig(dev, dtype, N, K, seed=1)
    kern = DenseDecode(dev, dtype)
    n = 5
    plain = rig.run(kern, n, out_f32=True)
    both = rig.run(kern, n, out_f32=True, bias=True, residual=True)
    want = (plain[:n, :N] + rig.bias[None]) + rig.res[:n, :N]  # the kernel's order: product, + bias, + residual
    assert np.array_equal(both[:n, :N], want.astype(np.float32))
    assert np.array_equal(both[n:], rig.res[n:]) and np.array_equal(both[:n, N:], rig.res[:n, N:])
    lo = rig.run(kern, n, out_f32=False)
    want_lo = to_f32(host_bits(plain[:n, :N], dtype), dtype)
    assert np.array_equal(np.asarray(lo[:n, :N], np.float32), want_lo), "T output = float32 result rounded once"


@pytest.mark.parametrize("shape", [(2048, 4096), (264, 2048)])
def test_every_knob_set_and_the_tuned_builds_give_the_same_bits(dev, shape) -> None:
    from hybrid_runtime.cuda.dense_decode import KNOB_SETS, TUNE_SETS, DenseDecode

    N, K = shape
    rig = Rig(dev, "bfloat16", N, K, seed=2)
    base = rig.run(DenseDecode(dev, "bfloat16"), 7, out_f32=True)
    for name, knobs in KNOB_SETS.items():
        got = rig.run(DenseDecode(dev, "bfloat16", knobs), 7, out_f32=True)
        np.testing.assert_allclose(got[:7, :N], rig.ref[:7], rtol=0, atol=2e-4 * np.sqrt(K), err_msg=name)
        if name in TUNE_SETS:  # what tune() may pick instead of the default: the same order, the same bits
            assert np.array_equal(got.view(np.uint32), base.view(np.uint32)), name


def test_tune_times_every_candidate_and_keeps_the_fastest(dev) -> None:
    from hybrid_runtime.cuda.dense_decode import KNOB_SETS, TUNE_SETS, DenseDecode

    rig = Rig(dev, "bfloat16", 2048, 4096, seed=3)
    kern = DenseDecode(dev, "bfloat16", KNOB_SETS["default"], [KNOB_SETS[k] for k in TUNE_SETS])
    out = dev.empty((16, 2048), "float32")
    times = kern.tune({(2048, 4096): [rig.w.ptr] * 4}, rig.x.ptr, rig.ldx, out.ptr, rows=(1, 16))
    t = times[(2048, 4096)]
    assert set(t) == {KNOB_SETS[k] for k in TUNE_SETS} and all(0 < v < 1e-3 for v in t.values()), t
    assert t[kern.choice[(2048, 4096)]] == min(t.values())
    with pytest.raises(ValueError, match="split K differently"):
        DenseDecode(dev, "bfloat16", KNOB_SETS["default"], [KNOB_SETS["kw256"]])


def test_refuses_bad_shapes(dev) -> None:
    from hybrid_runtime.cuda.dense_decode import DenseDecode

    kern = DenseDecode(dev, "bfloat16")
    with pytest.raises(ValueError, match="n 17"):
        kern.launch(17, 0, 2048, 0, 64, 2048, 0, 64, True)
    with pytest.raises(ValueError, match="K 100"):
        kern.launch(1, 0, 104, 0, 64, 100, 0, 64, True)
