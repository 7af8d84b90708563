"""The int4 / int8 decode GEMM (``cuda/nbits_decode.py``, ``ops/cuda/nbits_decode.cu``) on the GPU against
dequantise-then-GEMM in float64, on random packed operands of the Qwen3.5-35B-A3B decode layers (K x N: GDN in_proj
2048 x 12288, 2048 x 64, out_proj / o_proj 4096 x 2048, attention qkv 2048 x 9216, expert gate_up 2048 x 1024,
expert down 512 x 2048), 1 / 2 / 8 / 16 rows, 4 and 8 bits, group sizes 32 / 64 / 128 / -1, symmetric and
asymmetric, with and without an act-order permutation (with padding columns), bf16 and fp16, float32 and T outputs,
bias and the residual added in place; a row's bits the same alone and inside a 16-row step (batch invariance);
nothing written past row n or column N.

Tolerances (``Rig.check``):

* against x @ round_T(w).T in float64 - the T weight the build multiplies (exact build: (q - z) * s rounded once;
  fast build: (q - z) * round_T(s) rounded once, the same for float16-valued scales; sacc build: w itself, q - z
  exact in T and the float32 scale on the accumulator) - only the float32 accumulation differs: |err| <= 2^-16 *
  sum_k |x w| (about K / 16 float32 additions of mma partial sums, each off by at most 2^-24 of the running
  magnitude, for K <= 4096; sacc: one more float32 rounding per 128 k, the scaled partial);
* against x @ w.T with the unrounded dequantised weight (float64): the T rounding of each weight adds at most u_T
  |x_k w_k| (the unit roundoff u_T: 2^-8 bfloat16, 2^-11 float16; 2 u for the fast bfloat16 build, whose scale is
  rounded too), so |err| <= (u_T + 2^-16) * sum_k |x w|, and a T output adds u_T |y|.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_bits import host_bits, to_f32
from nbits_decode_model import Packed, dequantize_op, random_packed, x_op

pytestmark = pytest.mark.gpu

CANARY = -7777.0
SHAPES = [(2048, 12288), (2048, 64), (4096, 2048), (2048, 9216), (2048, 1024), (512, 2048)]  # K, N
UNIT = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}  # unit roundoff
ACC = 2.0 ** -16


def make_packed(rng: np.random.Generator, K: int, N: int, bits: int, group: int, asym: bool, perm: bool) -> Packed:
    """A random operand; ``group`` -1 = one block per row; ``perm``: act order over k_in = K - 32 input columns
    (32 padding columns reading the zero column)."""
    bs = K if group == -1 else group
    return random_packed(rng, N, K, bits, bs, asym, K - 32 if perm else None, 0.01 if bits == 4 else 0.0006)


def mode_of(kn, bits: int, bs: int) -> str:
    """The dequantisation build ``kn`` runs on such weights: "sacc", "exact" or "fast" (8-bit: always exact)."""
    r = kn.resolve(bits, bs)
    return "exact" if bits == 8 or r.exact else "sacc" if r.sacc else "fast"


class Rig:
    def __init__(self, dev, dtype: str, p: Packed, seed: int = 0, mode: str | None = None) -> None:
        """``mode``: the reference of that dequantisation (:func:`mode_of`; default: the default build's)."""
        from hybrid_runtime.cuda.nbits_decode import DEFAULT_KNOBS, NBitsOperand

        mode = mode_of(DEFAULT_KNOBS, p.bits, p.bs) if mode is None else mode
        fast = mode == "fast"

        rng = np.random.default_rng(seed)
        self.dev, self.dtype, self.p = dev, dtype, p
        self.ldx = p.k_in + (3 if p.perm is not None else 8)  # act order: any leading dimension
        self.xb = host_bits(rng.standard_normal((16, self.ldx)).astype(np.float32), dtype)
        self.x = dev.upload(self.xb, dtype=dtype)
        self.bufs = [dev.upload(np.ascontiguousarray(p.B)), dev.upload(np.ascontiguousarray(p.scales))]
        zp = dev.upload(np.ascontiguousarray(p.zp)) if p.zp is not None else None
        perm = dev.upload(np.ascontiguousarray(p.perm)) if p.perm is not None else None
        self.bufs += [zp, perm]
        self.op = NBitsOperand(self.bufs[0].ptr, self.bufs[1].ptr, zp.ptr if zp else 0, perm.ptr if perm else 0,
                               p.K, p.N, p.bits, p.bs, p.k_in)
        self.w = dequantize_op(p)
        s_t = p.scales if not (fast and p.bits == 4) else to_f32(host_bits(p.scales, dtype), dtype)
        self.w_t = (self.w if mode == "sacc" else
                    to_f32(host_bits(dequantize_op(p, s_t).astype(np.float32), dtype), dtype).astype(np.float64))
        self.references(to_f32(self.xb, dtype))
        # the weights' own rounding: none for sacc, twice for the fast bf16 build (its scale is rounded too)
        self.unit = 0.0 if mode == "sacc" else UNIT[dtype] * (2 if fast and dtype == "bfloat16" and p.bits == 4 else 1)
        self.unit_out = max(self.unit, UNIT[dtype])  # a T output's rounding (the weights' allowance where larger)
        self.bias = rng.standard_normal(p.N).astype(np.float32)
        self.res = rng.standard_normal((16, p.N + 4)).astype(np.float32)
        self.b = dev.upload(self.bias)

    def references(self, x: np.ndarray) -> None:
        """The float64 references for the input x [16, ldx] (float32 values)."""
        xo = x_op(self.p, np.asarray(x, np.float64))  # [16, K]
        self.ref_t = xo @ self.w_t.T  # what the build multiplies, in float64
        self.ref = xo @ self.w.T  # dequantise-then-GEMM, unrounded
        self.absum = np.abs(xo) @ np.abs(self.w).T

    def run(self, kern, n: int, out_f32: bool, bias: bool = False, residual: bool = False, row: int = 0):
        """out [16, N + 4] after one call on rows row .. row + n - 1 of x (float32 or the dtype's bits, as float32);
        canaries elsewhere."""
        ldo = self.p.N + 4
        host = self.res.copy() if residual else np.full((16, ldo), CANARY, np.float32)
        out = self.dev.upload(host) if out_f32 else self.dev.upload(host_bits(host, self.dtype), dtype=self.dtype)
        kern.launch(n, self.x.ptr + row * self.ldx * 2, self.ldx, self.op, out.ptr, ldo, out_f32,
                    residual=out.ptr if residual else 0, ldr=ldo if residual else 0, bias=self.b.ptr if bias else 0)
        self.dev.synchronize()
        got = self.dev.download(out)
        return np.asarray(got, np.float32)

    def check(self, got: np.ndarray, n: int, row: int = 0, out_t: bool = False) -> None:
        N = self.p.N
        g = got[:n, :N].astype(np.float64)
        rows = slice(row, row + n)
        extra = self.unit_out * np.abs(self.ref[rows]) if out_t else 0.0
        np.testing.assert_array_less(np.abs(g - self.ref_t[rows]), ACC * self.absum[rows] + extra + 1e-30,
                                     err_msg="vs the T weight the build multiplies")
        np.testing.assert_array_less(np.abs(g - self.ref[rows]), (self.unit + ACC) * self.absum[rows] + extra + 1e-30,
                                     err_msg="vs dequantise-then-GEMM")
        canary = to_f32(host_bits(np.array([CANARY], np.float32), self.dtype), self.dtype)[0] if out_t else CANARY
        assert (got[n:] == canary).all() and (got[:, N:] == canary).all(), "wrote past row n or column N"


VARIANTS = [(g, a, pm) for g in (32, 64, 128, -1) for a in (False, True) for pm in (False, True)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"K{s[0]}xN{s[1]}")
def test_matches_dequantise_then_gemm_and_is_batch_invariant(dev, dtype, bits, shape) -> None:
    """Each (shape, bits, dtype) takes two of the 16 (group, sym, perm) variants, so that every variant meets
    every bit width and dtype across the grid."""
    from hybrid_runtime.cuda.nbits_decode import NBitsDecode

    K, N = shape
    i = SHAPES.index(shape) * 4 + (bits == 8) * 2 + (dtype == "float16")
    kern = NBitsDecode(dev, dtype)
    for v in (VARIANTS[(2 * i) % 16], VARIANTS[(2 * i + 5) % 16]):
        rng = np.random.default_rng(i)
        rig = Rig(dev, dtype, make_packed(rng, K, N, bits, *v), seed=i)
        full = rig.run(kern, 16, out_f32=True)
        rig.check(full, 16)
        for n in (8, 2, 1):
            got = rig.run(kern, n, out_f32=True)
            rig.check(got, n)
            assert np.array_equal(got[:n, :N].view(np.uint32), full[:n, :N].view(np.uint32)), (v, n)
        for row in (5, 15):  # row i of the 16-row step == a 1-row launch of row i
            got = rig.run(kern, 1, out_f32=True, row=row)
            assert np.array_equal(got[:1, :N].view(np.uint32), full[row:row + 1, :N].view(np.uint32)), (v, row)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"g{v[0]}_{'asym' if v[1] else 'sym'}_"
                         f"{'perm' if v[2] else 'noperm'}")
@pytest.mark.parametrize("bits", [4, 8])
def test_every_variant_on_a_small_layer(dev, variant, bits) -> None:
    from hybrid_runtime.cuda.nbits_decode import NBitsDecode

    K, N = 512, 264  # 264: the last 16-row tile half empty
    rng = np.random.default_rng(bits + 7 * VARIANTS.index(variant))
    for dtype in ("bfloat16", "float16"):
        rig = Rig(dev, dtype, make_packed(rng, K, N, bits, *variant), seed=3)
        kern = NBitsDecode(dev, dtype)
        for n in (16, 9, 3, 1):
            rig.check(rig.run(kern, n, out_f32=True), n)
            rig.check(rig.run(kern, n, out_f32=False), n, out_t=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_bias_residual_in_place_and_dtype_output(dev, dtype) -> None:
    from hybrid_runtime.cuda.nbits_decode import NBitsDecode

    rig = Rig(dev, dtype, make_packed(np.random.default_rng(1), 2048, 1024, 4, 128, True, False), seed=1)
    kern = NBitsDecode(dev, dtype)
    n, N = 5, 1024
    plain = rig.run(kern, n, out_f32=True)
    both = rig.run(kern, n, out_f32=True, bias=True, residual=True)
    want = (plain[:n, :N] + rig.bias[None]) + rig.res[:n, :N]  # the kernel's order: product, + bias, + residual
    assert np.array_equal(both[:n, :N], want.astype(np.float32))
    assert np.array_equal(both[n:], rig.res[n:]) and np.array_equal(both[:n, N:], rig.res[:n, N:])
    lo = rig.run(kern, n, out_f32=False)
    want_lo = to_f32(host_bits(plain[:n, :N], dtype), dtype)
    assert np.array_equal(lo[:n, :N], want_lo), "T output = float32 result rounded once"


@pytest.mark.parametrize("bits", [4, 8])
def test_every_knob_set(dev, bits) -> None:
    """Every build of the benchmark is right (the exact and the fast dequantisation each against its own T
    weights); those that split K alike and dequantise alike give the same bits as the default."""
    from hybrid_runtime.cuda.nbits_decode import DEFAULT_KNOBS, KNOB_SETS, NBitsDecode

    for dtype in ("bfloat16", "float16"):
        for group in (64, 128):  # 64: the sacc builds run their twin without it
            p = make_packed(np.random.default_rng(bits + group), 2048, 2048, bits, group, True, False)
            rigs = {mode_of(DEFAULT_KNOBS, bits, group): Rig(dev, dtype, p, seed=2)}
            base = rigs[mode_of(DEFAULT_KNOBS, bits, group)].run(NBitsDecode(dev, dtype), 7, out_f32=True)
            for name, kn in KNOB_SETS.items():
                mode = mode_of(kn, bits, group)
                r = rigs.setdefault(mode, Rig(dev, dtype, p, seed=2, mode=mode))
                got = r.run(NBitsDecode(dev, dtype, kn), 7, out_f32=True)
                r.check(got, 7)
                if kn.same_bits(DEFAULT_KNOBS, bits, group):
                    assert np.array_equal(got.view(np.uint32), base.view(np.uint32)), (dtype, group, name)


@pytest.mark.parametrize("bits", [4, 8])
def test_tune_picks_a_build_per_shape_with_the_same_bits(dev, bits) -> None:
    """NBitsDecode.tune times every candidate (CUDA graphs) on each shape and keeps one of them; a launch then
    runs the chosen build, whose bits are the default build's (batch invariance and results do not depend on
    which build a load's timing picked)."""
    from hybrid_runtime.cuda.nbits_decode import DEFAULT_KNOBS, KNOB_SETS, TUNE_SETS, NBitsDecode

    dtype = "bfloat16"
    rigs = [Rig(dev, dtype, make_packed(np.random.default_rng(bits + i), K, N, bits, 128, False, i == 1), seed=i)
            for i, (K, N) in enumerate([(2048, 1024), (512, 264)])]
    base = [r.run(NBitsDecode(dev, dtype), 16, out_f32=True) for r in rigs]
    kern = NBitsDecode(dev, dtype, DEFAULT_KNOBS, [KNOB_SETS[n] for n in TUNE_SETS])
    ldx = -(-max(r.p.k_in for r in rigs) // 8) * 8  # scratch x: every k_in, 16-byte rows
    x = dev.upload(host_bits(np.zeros((16, ldx), np.float32), dtype), dtype=dtype)
    out = dev.upload(np.zeros((16, 1024), np.float32))
    shapes = {(r.p.N, r.p.K, bits): [r.op] for r in rigs}
    times = kern.tune(shapes, x.ptr, ldx, out.ptr, rows=(1, 16))
    assert set(times) == set(shapes) and set(kern.choice) == set(shapes)
    for key, t in times.items():
        assert set(t) == set(kern.builds) and all(v > 0 for v in t.values())
        assert kern.choice[key] == min(t, key=t.get) or t[DEFAULT_KNOBS] <= min(t.values())
    for r, b in zip(rigs, base, strict=True):
        got = r.run(kern, 16, out_f32=True)
        assert np.array_equal(got.view(np.uint32), b.view(np.uint32)), kern.choice
        for n in (1, 7):
            one = r.run(kern, n, out_f32=True)
            assert np.array_equal(one[:n].view(np.uint32), b[:n].view(np.uint32))


SACC_SHAPES = [(2048, 12288), (4096, 2048), (512, 2048)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", SACC_SHAPES, ids=lambda s: f"K{s[0]}xN{s[1]}")
def test_scale_on_accumulator_builds(dev, dtype, shape) -> None:
    """The sacc builds (int4, block sizes 128 and whole rows; sym / asym; with and without act order) against
    x @ w.T with the unrounded dequantised weight in float64 within the float32 accumulation bound alone (no T
    rounding of weights or scales); every sacc build (16 / 32 rows, the tuning candidates) gives the same bits, a
    row's bits alone == inside a 16-row step; and the worst relative error per output element is printed beside the
    fast build's (what the default's bf16-rounded scales cost)."""
    from hybrid_runtime.cuda.nbits_decode import DEFAULT_KNOBS, KNOB_SETS, NBitsDecode, tune_candidates

    K, N = shape
    sacc = KNOB_SETS["sacc"]
    builds = list(dict.fromkeys([sacc, KNOB_SETS["sacc_m32"], *tune_candidates(sacc)]))
    for i, (group, asym, perm) in enumerate([(128, True, False), (-1, False, False), (128, False, True)]):
        p = make_packed(np.random.default_rng(K + N + i), K, N, 4, group, asym, perm)
        rig = Rig(dev, dtype, p, seed=i, mode="sacc")
        full = rig.run(NBitsDecode(dev, dtype, sacc), 16, out_f32=True)
        rig.check(full, 16)
        for kn in builds[1:]:
            got = rig.run(NBitsDecode(dev, dtype, kn), 16, out_f32=True)
            assert np.array_equal(got.view(np.uint32), full.view(np.uint32)), kn
        kern = NBitsDecode(dev, dtype, sacc)
        for n in (1, 8):
            got = rig.run(kern, n, out_f32=True)
            assert np.array_equal(got[:n].view(np.uint32), full[:n].view(np.uint32)), n
        for row in (5, 15):
            got = rig.run(kern, 1, out_f32=True, row=row)
            assert np.array_equal(got[:1, :N].view(np.uint32), full[row:row + 1, :N].view(np.uint32)), row
        fast = rig.run(NBitsDecode(dev, dtype, DEFAULT_KNOBS), 16, out_f32=True)
        scale = np.abs(rig.absum) + 1e-30
        err = {name: float(np.max(np.abs(o[:16, :N] - rig.ref) / scale)) for name, o in (("sacc", full),
                                                                                          ("fast", fast))}
        print(f"{dtype} K{K}xN{N} group {group} {'asym' if asym else 'sym'}{' perm' if perm else ''}: max |err| / "
              f"sum|x w|: sacc {err['sacc']:.2e}, fast (default) {err['fast']:.2e}")
        assert err["sacc"] <= err["fast"]


@pytest.mark.parametrize("perm", [False, True])
def test_reads_x_only_after_the_kernel_before_it(dev, perm) -> None:
    """A programmatic dependent launched right behind the kernel that writes its input: its weight loads may start
    early, its reads of x must wait (griddepcontrol.wait)."""
    from hybrid_runtime.cuda.backend import fill_random
    from hybrid_runtime.cuda.kernels import load_module
    from hybrid_runtime.cuda.nbits_decode import NBitsDecode

    rig = Rig(dev, "bfloat16", make_packed(np.random.default_rng(9), 4096, 2048, 4, 128, True, perm), seed=9)
    kern = NBitsDecode(dev, "bfloat16")
    fused = load_module("fused.cu", ("-DDT=2",), dev.arch)
    out = dev.upload(np.full((16, 2048 + 4), CANARY, np.float32))
    for seed in (1, 2):
        fill_random(dev, fused, rig.x, seed, 1.0)  # x changes on the device right before the launch
        kern.launch(16, rig.x.ptr, rig.ldx, rig.op, out.ptr, 2048 + 4, True)
        rig.references(dev.download(rig.x))
        rig.check(np.asarray(dev.download(out), np.float32), 16)


def test_refuses_bad_shapes(dev) -> None:
    from hybrid_runtime.cuda.nbits_decode import NBitsDecode, NBitsOperand

    kern = NBitsDecode(dev, "bfloat16")
    op = NBitsOperand(256, 256, 0, 0, 2048, 64, 4, 128, 2048)
    with pytest.raises(ValueError, match="n 17"):
        kern.launch(17, 256, 2048, op, 256, 64, True)
    with pytest.raises(ValueError, match="K 2000"):
        kern.launch(1, 256, 2048, NBitsOperand(256, 256, 0, 0, 2000, 64, 4, 128, 2000), 256, 64, True)
