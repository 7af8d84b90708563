"""The packed-expert decode MoE (``cuda/moe_nbits_decode.py``, ``ops/cuda/moe_nbits_decode.cu``) on the GPU.

Random packed experts (independent codes, float16-valued scales, zero-points) of the Qwen3.5-35B-A3B expert shape
(H 2048, I 512, 256 experts + the shared one folded as expert 256, top-8) and a small one (H 256, I 128, 16 experts,
top-4), int4 and int8, symmetric and asymmetric, group sizes 32 / 64 / 128 / one block a row; routing as the backend
routes a step (fused.cu's moe_route up to 16 tokens, moe_topk + moe_group past that); steps of 1, 8, 16 tokens
(the shared expert folded) and 64 (not folded; one expert taking every token: two passes of 32 pairs), experts
without pairs (cold half of the experts), one expert with all pairs. Every case runs each build of :data:`BUILDS`
(the first shared-memory build and the dequantise-in-registers one); checked, per step and build:

* == dequantise-then-moe_decode: the experts dequantised on the device by the load path (nbits.cu) and run through
  moe_decode.cu's build with the same tiles (``NBitsKnobs.decode_knobs``): within |dy| <= 1e-5 max|y| (the stated
  tolerance; the design gives 0) and then BIT FOR BIT (same T weights in shared memory, same mma order);
* against a float64 numpy reference of the dequantised weights (a dequantiser of this test's own, from the format;
  act rounded to T as stored): per pair |dy| / |y| < 5e-3 and overall < 1e-3 (bf16 / fp16 rounding of act, float32
  accumulation), for steps whose experts the host can afford to dequantise;
* canaries: nothing written past y[:n, :kk] and act[:n*kk]; every pair's act row written;
* batch invariance: the first token alone == inside a 16- and a 64-token step, bit for bit;
* the builds agree with each other bit for bit (every build of KNOB_SETS: test_every_knob_set_gives_the_default_bits).

``-s`` prints one line per (shape, variant, build): the largest |y - ref64| / max|ref64|, |y - moe_decode| and
whether every step was bit-identical. The modules the file loads are compiled first, in parallel worker processes
(kernels.warm_cache), into the disk cache.
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest
from gpu_bits import host_bits, to_f32
from test_moe_decode_gpu import CANARY, DT, logits_for, reference_route

pytestmark = pytest.mark.gpu

SHAPES = {"a35b": (2048, 512, 256, 8), "small": (256, 128, 16, 4)}
# (n, case, fold), largest first: later, smaller steps run over the stale routing buffers of larger ones
STEPS = [(64, "one_takes_all", False), (16, "spread", True), (16, "one_takes_all", True), (8, "cold_experts", True),
         (8, "spread", False), (1, "spread", True)]
REF_TOL = 1e-5  # |y - moe_decode(dequantised)| <= REF_TOL * max |y| (the design: 0, checked next)
# the builds every case runs: the T tile in shared memory (reg 0) and the A fragments in registers (reg 1); the first
# also against the float64 reference, the others bit for bit against it
BUILDS = ("default", "reg")


def _module_jobs(arch: str) -> list[tuple[str, tuple[str, ...], str]]:
    """(source, options, arch) of every moe_nbits_decode / moe_decode module this file loads."""
    from hybrid_runtime.cuda import moe_decode
    from hybrid_runtime.cuda.moe_nbits_decode import ALL_SETS, SOURCE, WIDE_BK

    jobs = []
    for dtype, names in (("bfloat16", list(ALL_SETS)), ("float16", [*BUILDS, *SACC_BUILDS])):
        for name in names:
            kn = ALL_SETS[name]
            jobs += [(SOURCE, kn.options(dtype, bits), arch) for bits in (4, 8) if kn.runs_bits(bits)]
            if kn.bk != WIDE_BK:  # (a 256-k sacc build has no moe_decode twin)
                jobs.append((moe_decode.SOURCE, (f"-DDT={DT[dtype]}", *kn.decode_knobs().options), arch))
    return jobs


@pytest.fixture(scope="module")
def dev():
    import torch

    torch.cuda.init()
    from hybrid_runtime.cuda.driver import CudaDevice
    from hybrid_runtime.cuda.kernels import warm_cache

    d = CudaDevice(0)
    warm_cache(_module_jobs(d.arch))
    return d


def host_dequant(B: np.ndarray, scales: np.ndarray, zp: np.ndarray | None, bits: int, bs: int, K: int
                 ) -> np.ndarray:
    """float64 [rows, K] of packed rows (this test's own reading of the MatMulNBits layout): codes along K, 4-bit
    two a byte low nibble first; zero-points per block, 4-bit two a byte low nibble first, default 2^(bits-1)."""
    rows, nb = B.shape[0], K // bs
    if bits == 4:
        q = np.stack([B & 15, B >> 4], -1).reshape(rows, K).astype(np.int64)
    else:
        q = B.astype(np.int64)
    if zp is None:
        z = np.full((rows, nb), 1 << (bits - 1), np.int64)
    elif bits == 4:
        z = np.stack([zp & 15, zp >> 4], -1).reshape(rows, -1)[:, :nb].astype(np.int64)
    else:
        z = zp.astype(np.int64)
    return (q - np.repeat(z, bs, 1)) * np.repeat(scales.astype(np.float64), bs, 1)


class Rig:
    """Packed experts of one (shape, bits): codes fixed, scales / zero-points / group size per :meth:`variant`;
    the load path's dequantised copies; routing and output buffers for up to 64 tokens; both kernels."""

    def __init__(self, dev, dtype: str, shape: str, bits: int) -> None:
        from hybrid_runtime.cuda.kernels import load_module
        from hybrid_runtime.cuda.moe_prefill import ROUTE_MAX_CTAS, MoEPrefill, tile_list_words
        from hybrid_runtime.cuda.quant import NBitsDequant

        self.dev, self.dtype, self.shape, self.bits = dev, dtype, shape, bits
        H, inter, E, k = SHAPES[shape]
        self.H, self.I, self.E, self.k, self.e_all = H, inter, E, k, E + 1
        self.ny = k + 2  # slots past kk: never written (canaries)
        self.ld = -(-(E + 1) // 8) * 8 + 8
        rng = np.random.default_rng(100 * bits + H)
        # codes: gate_up [E_all * 2I, H * bits / 8], down [E_all * H, I * bits / 8]
        self.codes = {"gate_up": (2 * inter, H), "down": (H, inter)}
        self.hB = {kind: np.frombuffer(rng.bytes(self.e_all * R * K * bits // 8), np.uint8).reshape(
            self.e_all * R, K * bits // 8) for kind, (R, K) in self.codes.items()}
        self.dB = {kind: dev.upload(b) for kind, b in self.hB.items()}
        self.fused = load_module("fused.cu", (f"-DDT={DT[dtype]}",), dev.arch)
        self.deq = NBitsDequant(dev, dtype)
        self.router = MoEPrefill(dev, dtype, impl="mma")
        self.wt = {"gate_up": dev.empty((self.e_all, 2 * inter, H), dtype), "down": dev.empty((self.e_all, H, inter),
                                                                                                dtype)}
        n_max = 64
        P = n_max * (k + 1)
        self.b = {name: dev.empty(shape_, dt) for name, shape_, dt in (
            ("pw", (P,), "float32"), ("pe", (P,), "int32"), ("pl", (P,), "int32"), ("off", (E + 2,), "int32"),
            ("active", (E + 2,), "int32"), ("tiles", (tile_list_words(P, E + 1),), "int32"),
            ("cta", (ROUTE_MAX_CTAS, E + 1), "int32"), ("act", (P, inter), dtype),
            ("y", (n_max, self.ny, H), "float32"), ("act_ref", (P, inter), dtype),
            ("y_ref", (n_max, self.ny, H), "float32"))}
        self.ops: dict = {}
        self._t: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def variant(self, group: int, asym: bool, seed: int, short: bool = True) -> None:
        """New scales (and zero-points when ``asym``) of block size ``group``; the experts dequantised on the device
        (nbits.cu, the load path) into the bf16 / fp16 stacks moe_decode reads. ``short``: float16-valued scales
        (GPTQ's; the int4 reg builds take the FFMA dequantisation), else random float32 ones (FADD + FMUL)."""
        from hybrid_runtime.cuda.moe_nbits_decode import NBitsExperts, short_scales
        from hybrid_runtime.cuda.quant import PackedLinear

        rng = np.random.default_rng(seed)
        self.group, self.asym = group, asym
        self.host: dict = {}
        self._t = {}
        for kind, (R, K) in self.codes.items():
            bs = K if group == -1 else group  # -1: one block a row (gate_up and down then differ)
            nb = K // bs
            rows = self.e_all * R
            scale = 0.01 if self.bits == 4 else 0.0006
            scales = (rng.uniform(0.5, 1.5, (rows, nb)) * scale).astype(np.float32)
            if short:
                scales = scales.astype(np.float16).astype(np.float32)
            assert short_scales(scales) == short
            zp = None
            if asym:
                zw = (nb + 1) // 2 if self.bits == 4 else nb
                zp = np.frombuffer(rng.bytes(rows * zw), np.uint8).reshape(rows, zw).copy()
            d_s = self.dev.upload(scales)
            d_z = self.dev.upload(zp) if zp is not None else None
            self.host[kind] = (scales, zp)
            p = PackedLinear(self.dB[kind], d_s, d_z, None, K, R, self.bits, bs, K, self.e_all)
            self.deq.launch(p, self.wt[kind].ptr, K, R * K)
            self.ops[kind] = (NBitsExperts(self.dB[kind].ptr, d_s.ptr, d_z.ptr if d_z is not None else 0, self.e_all,
                                           R, K, self.bits, bs, short=short), d_s, d_z)
        self.dev.synchronize()

    @property
    def gu(self):
        return self.ops["gate_up"][0]

    @property
    def dn(self):
        return self.ops["down"][0]

    def expert_t(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Expert e's T weights (gate_up [2I, H], down [H, I]) dequantised on the HOST: float64 (q - z) * s rounded
        to float32, then to T (the load path's rounding)."""
        if e not in self._t:
            gu, dn = (to_f32(host_bits(w.astype(np.float32), self.dtype), self.dtype).astype(np.float64)
                      for w in self.expert_q(e))
            self._t[e] = (gu, dn)
        return self._t[e]

    def expert_q(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Expert e's quantized weights (gate_up [2I, H], down [H, I]) in float64, NOT rounded: (q - z) * s, the
        model the scale-on-accumulator builds compute with."""
        out = []
        for kind, (R, K) in self.codes.items():
            s, z = self.host[kind]
            sl = slice(e * R, (e + 1) * R)
            bs = K if self.group == -1 else self.group
            out.append(host_dequant(self.hB[kind][sl], s[sl], None if z is None else z[sl], self.bits, bs, K))
        return out[0], out[1]

    def bufs(self, ref: bool = False):
        from hybrid_runtime.cuda.moe_prefill import MoEBuffers

        b = self.b
        return MoEBuffers(b["pw"].ptr, b["pe"].ptr, b["pl"].ptr, b["off"].ptr, b["active"].ptr, b["tiles"].ptr,
                          b["cta"].ptr, b["act_ref" if ref else "act"].ptr, b["y_ref" if ref else "y"].ptr,
                          (b["tiles"].size - 4) // 4)

    def run(self, moe, ref, n: int, h_bits: np.ndarray, logits: np.ndarray, fold: bool) -> dict[str, np.ndarray]:
        """One step: canaries, routing (moe_route up to 16 tokens, moe_topk + moe_group past that), ``moe`` (a
        MoENBitsDecode) on the packed experts and ``ref`` (a MoEDecode or None) on the dequantised ones."""
        dev, b, H = self.dev, self.b, self.H
        for k_ in (moe, ref):  # one stream orders the canaries, routing and experts: the kernels' device is the rig's
            assert k_ is None or k_.device is dev, "kernels of another CudaDevice (another stream) than the rig's"
        hd = dev.upload(h_bits, dtype=self.dtype)
        lg = dev.upload(np.ascontiguousarray(logits, np.float32))
        for name in ("y", "y_ref"):
            self.fused.kernel("fill_f32").launch(dev, (-(-b[name].size // 256), 1, 1), (256, 1, 1), 0,
                                                 [("ptr", b[name].ptr), ("f32", CANARY), ("i64", b[name].size)])
        for name in ("act", "act_ref"):
            dev.memset_d8(b[name].ptr, 0xFF, b[name].nbytes)  # a NaN in bf16 and fp16
        kk, e_all = self.k + int(fold), self.E + int(fold)
        if n > 16:
            self.router.route(n, lg.ptr, self.ld, self.E, self.k, True, self.bufs(), fold_shared=fold)
        else:
            self.fused.kernel("moe_route").launch(
                dev, (1, 1, 1), (1024, 1, 1), 0,
                [("ptr", lg.ptr), ("i32", self.ld), ("i32", n), ("i32", self.E), ("i32", self.k), ("i32", 1),
                 ("i32", int(fold)), ("ptr", b["pw"].ptr), ("ptr", b["pe"].ptr), ("ptr", b["off"].ptr),
                 ("ptr", b["pl"].ptr), ("ptr", b["active"].ptr)], pdl=True)
        moe.launch(n, hd.ptr, H, self.gu, self.dn, H, self.I, kk, self.ny, e_all, self.bufs())
        if ref is not None:
            ref.launch(n, hd.ptr, H, self.wt["gate_up"].ptr, self.wt["down"].ptr, H, self.I, kk, self.ny, e_all,
                       self.bufs(ref=True))
        dev.synchronize()
        out = {name: dev.download(a) for name, a in b.items() if name not in ("tiles", "cta")}
        del hd, lg
        return out

    def reference(self, h: np.ndarray, top: np.ndarray, w: np.ndarray, exact: bool = False) -> np.ndarray:
        """y [n, kk, H] float64 from the host-dequantised T weights (``exact``: the unrounded (q - z) * s), act
        rounded to T as stored."""
        n, kk = top.shape
        y = np.zeros((n, kk, self.H))
        for e in np.unique(top):
            t, j = np.nonzero(top == e)
            gu, dn = (self.expert_q if exact else self.expert_t)(int(e))
            x = h[t].astype(np.float64) @ gu.T
            a = x[:, :self.I] / (1 + np.exp(-x[:, :self.I])) * x[:, self.I:]
            a = to_f32(host_bits(a.astype(np.float32), self.dtype), self.dtype).astype(np.float64)
            y[t, j] = w[t, j, None] * (a @ dn.T)
        return y


# Both caches are keyed by the device too: another module imports ``dev`` and ``rig`` (test_moe_prefill_packed_gpu),
# so each module has a CudaDevice of its own, each with its own stream. A rig or kernel of one device used with
# the other's ran the memsets and routing on one stream and the experts on the other, unordered: a race that left
# canary NaNs in act about one run in two (seen on the H100 and H200; Rig.run now refuses the mix).
_rigs: dict[tuple, Rig] = {}
_kernels: dict[tuple, object] = {}


def rig(dev, dtype: str, shape: str, bits: int) -> Rig:
    if (dev, dtype, shape, bits) not in _rigs:
        _rigs.clear()  # one at a time: the 35B stacks are 0.4 / 0.8 GB packed + 1.6 GB dequantised
        _rigs[dev, dtype, shape, bits] = Rig(dev, dtype, shape, bits)
    return _rigs[dev, dtype, shape, bits]


def kernels(dev, dtype: str, knobs: str = "default"):
    """(MoENBitsDecode, the MoEDecode build with the same tiles) of ALL_SETS[knobs], on ``dev``."""
    from hybrid_runtime.cuda.moe_decode import MoEDecode
    from hybrid_runtime.cuda.moe_nbits_decode import ALL_SETS, WIDE_BK, MoENBitsDecode

    if (dev, dtype, knobs) not in _kernels:
        kn = ALL_SETS[knobs]
        twin = None
        if kn.bk != WIDE_BK:  # a 256-k sacc build has none (never compared bit for bit)
            dk = kn.decode_knobs()
            if (dev, dtype, dk) not in _kernels:
                _kernels[dev, dtype, dk] = MoEDecode(dev, dtype, **asdict(dk))
            twin = _kernels[dev, dtype, dk]
        _kernels[dev, dtype, knobs] = (MoENBitsDecode(dev, dtype, kn), twin)
    return _kernels[dev, dtype, knobs]


def check_step(r: Rig, got: dict[str, np.ndarray], n: int, hb: np.ndarray, lg: np.ndarray, fold: bool, label: str,
               case: str, ref64: bool, stats: dict) -> None:
    E, k = r.E, r.k
    kk = k + int(fold)
    P = n * kk
    top, w = reference_route(lg, E, k, fold)
    assert np.array_equal(got["pe"][:P].reshape(n, kk), top), label
    if case == "one_takes_all":
        assert np.diff(got["off"][:E + int(fold) + 1])[E // 3] == n, label
    y, yr = got["y"][:n, :kk].astype(np.float64), got["y_ref"][:n, :kk].astype(np.float64)
    scale = max(float(np.abs(yr).max()), 1e-30)
    d_ref = float(np.abs(y - yr).max())
    stats["dec"] = max(stats.get("dec", 0.0), d_ref / scale)
    assert d_ref <= REF_TOL * scale, (label, "vs dequantise-then-moe_decode", d_ref, scale)
    same = got["y"][:n, :kk].tobytes() == got["y_ref"][:n, :kk].tobytes() and \
        got["act"][:P].tobytes() == got["act_ref"][:P].tobytes()
    stats["bits"] = stats.get("bits", True) and same
    if ref64:
        want = r.reference(to_f32(hb, r.dtype), top, w)
        err = np.linalg.norm(y - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-30)
        stats["f64"] = max(stats.get("f64", 0.0), float(np.abs(y - want).max() / np.abs(want).max()))
        assert err.max() < 5e-3, (label, "vs float64", float(err.max()))
        assert np.linalg.norm(y - want) / np.linalg.norm(want) < 1e-3, label
    assert (got["y"][n:] == CANARY).all() and (got["y"][:n, kk:] == CANARY).all(), label
    assert np.isnan(got["act"][P:]).all() and not np.isnan(got["act"][:P]).any(), label
    assert same, (label, "not bit-identical to moe_decode on the dequantised weights")


def _variants(shape: str, bits: int) -> list[tuple[int, bool]]:
    """(group, asym; -1: one block a row): every one on the small shape; on the 35B shape two or three per bit width,
    every group across them."""
    if shape == "small":
        return [(g, a) for g in (32, 64, 128, -1) for a in (False, True)]
    return [(32, True), (128, False)] if bits == 4 else [(64, False), (128, True), (-1, True)]


@pytest.mark.parametrize("dtype,shape", [("bfloat16", "a35b"), ("bfloat16", "small"), ("float16", "small")])
@pytest.mark.parametrize("bits", [4, 8])
def test_matches_dequantise_then_moe_decode_and_float64(dev, dtype: str, shape: str, bits: int) -> None:
    builds = {name: kernels(dev, dtype, name) for name in BUILDS}
    r = rig(dev, dtype, shape, bits)
    for vi, (group, asym) in enumerate(_variants(shape, bits)):
        r.variant(group, asym, seed=vi)
        rng = np.random.default_rng(vi)
        stats: dict = {name: {} for name in BUILDS}
        for n, case, fold in STEPS:
            hb = host_bits(rng.standard_normal((n, r.H)).astype(np.float32), dtype)
            lg = logits_for(rng, n, r.E, r.ld, case)
            ref64 = shape == "small" or n == 1  # the 35B shape: 9 experts to dequantise on the host
            label = f"{dtype} {shape} int{bits} g{group} {'asym' if asym else 'sym'} n={n} {case} fold={fold}"
            first = None
            for name, (moe, ref) in builds.items():
                got = r.run(moe, ref, n, hb, lg, fold)
                check_step(r, got, n, hb, lg, fold, f"{name}: {label}", case, ref64 and first is None, stats[name])
                if first is None:
                    first = got
                else:  # the float64 check of the first build holds for this one: the same bits
                    assert got["y"].tobytes() == first["y"].tobytes(), (name, label)
                    assert got["act"].tobytes() == first["act"].tobytes(), (name, label)
        for name in BUILDS:
            st = stats[name]
            print(f"\n[moe_nbits] {name} {dtype} {shape} int{bits} g{group} {'asym' if asym else 'sym'}: "
                  f"max|y-ref64|/max|ref64| {stats[BUILDS[0]].get('f64', float('nan')):.2e}, max|y-moe_decode|/max "
                  f"{st['dec']:.2e}, bit-identical {st['bits']}")


def _check_batch_invariance(dev, bits: int, builds: tuple[str, ...]) -> None:
    """The first token alone == inside a 16-token step (shared expert folded) and two 64-token ones (not folded;
    one expert taking every token: two passes), act and y bit for bit, for each of ``builds`` on the 35B shape; the
    builds (one k split) give each other's bits."""
    r = rig(dev, "bfloat16", "a35b", bits)
    r.variant(128, True, seed=7)
    rng = np.random.default_rng(11)
    hb = host_bits(rng.standard_normal((64, r.H)).astype(np.float32), "bfloat16")
    for n, case, fold in ((16, "spread", True), (64, "one_takes_all", False), (64, "spread", False)):
        lg = logits_for(rng, n, r.E, r.ld, case)
        kk = r.k + int(fold)
        first = None
        for name in builds:
            moe, _ = kernels(dev, "bfloat16", name)
            big = r.run(moe, None, n, np.ascontiguousarray(hb[:n]), lg, fold)
            small = r.run(moe, None, 1, np.ascontiguousarray(hb[:1]), np.ascontiguousarray(lg[:1]), fold)
            label = f"{name} int{bits} n={n} {case}"
            assert np.array_equal(small["pe"][:kk], big["pe"][:kk]), label
            assert small["y"][:1, :kk].tobytes() == big["y"][:1, :kk].tobytes(), label
            assert small["act"][:kk].tobytes() == big["act"][:kk].tobytes(), label
            first = first or big
            assert big["y"].tobytes() == first["y"].tobytes() and big["act"].tobytes() == first["act"].tobytes(), \
                label
    print(f"\n[moe_nbits] int{bits} batch invariance (1 vs 16 / 64 tokens), builds {', '.join(builds)}: bit-identical "
          "True")


@pytest.mark.parametrize("bits", [4, 8])
def test_a_tokens_bits_do_not_depend_on_the_other_tokens(dev, bits: int) -> None:
    """Batch invariance on the 35B shape (_check_batch_invariance) of the exact builds of :data:`BUILDS`."""
    _check_batch_invariance(dev, bits, BUILDS)


def test_every_knob_set_gives_the_default_bits(dev) -> None:
    """Every build of KNOB_SETS (they split K alike) == the default build bit for bit, and == its moe_decode twin,
    on the small shape (int4 with float16-valued scales: the reg builds' FFMA dequantisation, and with float32 ones:
    FADD + FMUL; int8) and the 35B shape (int4, 1 and 16 tokens)."""
    from hybrid_runtime.cuda.moe_nbits_decode import KNOB_SETS, uses_fma

    fma_runs = 0
    for shape, bits, steps, short in (("small", 4, STEPS, True), ("small", 4, STEPS, False), ("small", 8, STEPS, True),
                                      ("a35b", 4, [STEPS[1], STEPS[-1]], True)):
        r = rig(dev, "bfloat16", shape, bits)
        r.variant(64, True, seed=3, short=short)
        fma_runs += sum(uses_fma(r.gu, kn) and uses_fma(r.dn, kn) for kn in KNOB_SETS.values())
        rng = np.random.default_rng(5)
        for n, case, fold in steps:
            hb = host_bits(rng.standard_normal((n, r.H)).astype(np.float32), "bfloat16")
            lg = logits_for(rng, n, r.E, r.ld, case)
            base = r.run(*kernels(dev, "bfloat16"), n, hb, lg, fold)
            for name in KNOB_SETS:
                got = r.run(*kernels(dev, "bfloat16", name), n, hb, lg, fold)
                label = f"{name} {shape} int{bits} {'short' if short else 'float32'} scales n={n} {case}"
                check_step(r, got, n, hb, lg, fold, label, case, False, {})
                assert got["y"].tobytes() == base["y"].tobytes() and got["act"].tobytes() == base["act"].tobytes(), \
                    label
    assert fma_runs > 0, "no build ran the FFMA dequantisation"


def test_launch_refuses_what_it_does_not_run(dev) -> None:
    """ValueError before any launch: act order, mixed bit widths, a block size not dividing K."""
    from dataclasses import replace

    from hybrid_runtime.cuda.moe_nbits_decode import NBitsExperts
    from hybrid_runtime.cuda.moe_prefill import MoEBuffers

    moe, _ = kernels(dev, "bfloat16")
    gu = NBitsExperts(256, 256, 0, 257, 1024, 2048, 4, 128)
    dn = NBitsExperts(256, 256, 0, 257, 2048, 512, 4, 128)
    b = MoEBuffers(*([0] * 9), 0)
    for bad_gu, bad_dn, msg in ((replace(gu, perm=256), dn, "act order"), (gu, replace(dn, bits=8), "one bit width"),
                                (replace(gu, block_size=96), dn, "divide K")):
        with pytest.raises(ValueError, match=msg):
            moe.launch(1, 256, 2048, bad_gu, bad_dn, 2048, 512, 9, 9, 257, b)


@pytest.mark.parametrize("bits,sym,builds", [(4, False, ("default", "many")), (4, False, ("reg_late", "reg_g1")),
                                             (8, True, ("reg", "reg_many"))])
def test_backend_packed_experts_give_the_dequantised_bundles_bits(tmp_path, monkeypatch: pytest.MonkeyPatch, bits: int,
                                                                  sym: bool, builds: tuple[str, str]) -> None:
    """``CudaBackend(packed_experts=True)`` (its ``MOE_NBITS_BUILDS`` set to run ``builds[0]`` for 1-row steps and
    ``builds[1]`` for the others; the float16 scales of the tests' GPTQ packer are short, so the int4 reg builds run
    the FFMA dequantisation) on a bf16 GPTQ bundle whose MoE layers stack (tests/gptq_cases.py
    PACKED_EXPERTS: H 128, experts and folded shared expert of I 64) against the same bundle dequantised at load:
    fewer weight bytes; prefill (the layer's experts dequantised into the scratch stack, then the same grouped
    GEMMs) and decode (the packed twin of moe_decode: the same bits) give the same logits BIT FOR BIT, teacher-forced
    over prefill chunks and 12 decode steps of 3 sequences."""
    from runner_cases import Driver, scattered_tables

    from hybrid_runtime.config import Manifest
    from hybrid_runtime.cuda import backend as backend_mod
    from hybrid_runtime.cuda import moe_nbits_decode
    from hybrid_runtime.cuda.backend import CudaBackend
    from hybrid_runtime.runner import ModelRunner
    from tests import gptq_cases as gc

    table = {b: ((1, builds[0]), (1 << 30, builds[1])) for b in (4, 8)}  # builds[0] for 1-row steps, [1] the rest
    monkeypatch.setattr(backend_mod, "MOE_NBITS_BUILDS", table)
    monkeypatch.setattr(moe_nbits_decode, "BACKEND_BUILDS", table)  # (weights.packed_layer_experts reads it)
    b = gc.packed_experts_bundle(tmp_path, bits=bits, sym=sym)
    m = Manifest.load(b)
    packed = CudaBackend(b, m, device="cuda", packed_experts=True)
    plain = CudaBackend(b, m, device="cuda")
    assert packed.w.packed_moe and not plain.w.packed_moe
    assert packed.moe_nbits_table is table  # the experts alone packed: BACKEND_BUILDS (the exact builds' table)
    assert set(packed.moe_nbits) == set(builds)
    assert all(pk.gate_up.short and pk.down.short for pk in packed.w.packed_moe.values())  # GPTQ's float16 scales
    assert packed.w.nbytes < plain.w.nbytes
    rng = np.random.default_rng(bits)
    lens, slots, decode_steps = [37, 20, 5], [3, 0, 2], 12
    prompts = [rng.integers(3, m.model.vocab_size, n).tolist() for n in lens]
    tables = scattered_tables(m, [n + decode_steps for n in lens], seed=bits)
    drv = Driver([ModelRunner(b, m, backend=plain), ModelRunner(b, m, backend=packed)], slots, tables, prompts)
    steps = [list(r) for r in drv.prefill(chunk=5)] + [list(drv.decode()) for _ in range(decode_steps)]
    worst = max(float(np.abs(a - c).max()) for a, c in steps)
    print(f"\n[moe_nbits] backend packed_experts {builds[0]} int{bits} {'sym' if sym else 'asym'}: {len(steps)} steps, "
          f"max |logit "
          f"diff| {worst:.3e}, weight bytes {packed.w.nbytes} vs {plain.w.nbytes}, packed MoE launches "
          f"{packed.moe_nbits_calls}")
    assert packed.moe_nbits_calls > 0, "no decode step ran the packed-expert kernels"
    for i, (a, c) in enumerate(steps):
        assert np.array_equal(a, c), (i, float(np.abs(a - c).max()))


@pytest.mark.parametrize("mode", ["all", "dual"])
def test_runner_packed_weights_all_serves_a_gptq_bundle(tmp_path, mode: str) -> None:
    """``ModelRunner(packed_weights="all")`` (the deployment parameter; CUDA graphs captured as served) on a bf16
    int4 GPTQ bundle whose MoE layers stack: the dense projections and the experts stay packed (fewer weight
    bytes; the experts on the sacc builds of FAST_BUILDS), the captured decode graphs hold the packed kernels, and
    the logits follow the dequantised bundle's
    (``packed_weights="off"``), teacher-forced over 12 decode steps of 3 sequences: prefill bit for bit
    (everything dequantised into scratch first); decode as test_nbits_gpu's packed_linears bound (the packed decode
    GEMM's 4-bit build multiplies by the bf16-rounded scale and sums in another order than dense_decode; the packed
    MoE gives moe_decode's bits, but a router near-tie can then pick another expert and move a row by O(1)): 90% of
    rows within 2% of the logits' scale, the same greedy token on >= 90% of rows, the worst row reported.
    ``packed_weights="dual"``: the experts packed, the projections in both forms - the captured decode graphs hold
    the packed kernels, prefill runs on the dequantised copies (bit for bit, no scratch, no dequantise-first
    fallback), decode within the same bound."""
    from runner_cases import Driver, scattered_tables

    from hybrid_runtime.config import Manifest
    from hybrid_runtime.runner import ModelRunner
    from tests import gptq_cases as gc

    b = gc.packed_experts_bundle(tmp_path, bits=4)
    m = Manifest.load(b)
    off = ModelRunner(b, m, device="cuda", packed_weights="off")
    on = ModelRunner(b, m, device="cuda", packed_weights=mode)
    be = on.backend
    from hybrid_runtime.cuda.moe_nbits_decode import FAST_BUILDS

    assert be.moe_nbits_table is FAST_BUILDS  # type: ignore[attr-defined]  # the projections packed: the sacc builds
    if mode == "all":
        assert be.w.packed_only and be.w.packed_moe and not off.backend.w.packed_only  # type: ignore[attr-defined]
        assert be.w.nbytes < off.backend.w.nbytes and be.graphs  # type: ignore[attr-defined]
    else:
        assert be.w.packed_decode and be.w.packed_moe and not be.w.packed_only  # type: ignore[attr-defined]
        assert be.nbits_scratch is None and be.graphs  # type: ignore[attr-defined]
    calls0 = (be.moe_nbits_calls, be.nbits_calls)  # type: ignore[attr-defined]
    assert min(calls0) > 0, "the captured decode graphs hold no packed kernel"
    rng = np.random.default_rng(4)
    lens, slots, decode_steps = [29, 11, 4], [1, 0, 2], 12
    prompts = [rng.integers(3, m.model.vocab_size, n).tolist() for n in lens]
    tables = scattered_tables(m, [n + decode_steps for n in lens], seed=4)
    drv = Driver([off, on], slots, tables, prompts)
    for a, c in drv.prefill(chunk=5):  # 3 x 5 tokens <= the bundle's max_num_tokens (16)
        assert np.array_equal(a, c), float(np.abs(a - c).max())
    dec = [drv.decode() for _ in range(decode_steps)]
    rows = np.concatenate([np.abs(a - c).max(axis=1) for a, c in dec])
    scale = max(float(np.abs(a).max()) for a, _ in dec)
    agree = sum(int((a.argmax(1) == c.argmax(1)).sum()) for a, c in dec) / rows.size
    if mode == "dual":
        assert be.nbits_fallbacks == 0  # type: ignore[attr-defined]
    print(f"\n[moe_nbits] runner packed_weights={mode} int4: weight bytes {be.w.nbytes} vs {off.backend.w.nbytes}, "
          f"decode |logit diff| p90 {np.percentile(rows, 90) / scale:.2e} / max {rows.max() / scale:.2e} of the "
          f"scale, greedy agreement {agree:.2f}")
    assert np.percentile(rows, 90) <= 2e-2 * scale and agree >= 0.9


# The int4 builds with the scale on the accumulator (moe_nbits_decode.SACC_SETS): not the dequantised weights' bits.
# Each group splits K alike (one k tile): its builds give each other's bits.
SACC_GROUPS = (("sacc_g1", "sacc_wide"), ("sacc_wide_k256", "sacc_g1_k256"))
SACC_BUILDS = tuple(name for group in SACC_GROUPS for name in group)


def _rel(y: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """(worst pair's |y - want| / |want|, the whole step's) in the 2-norm over H."""
    per = np.linalg.norm(y - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-30)
    return float(per.max()), float(np.linalg.norm(y - want) / np.linalg.norm(want))


@pytest.mark.parametrize("dtype,shape", [("bfloat16", "a35b"), ("bfloat16", "small"), ("float16", "small")])
def test_scale_on_accumulator_builds_match_the_quantized_model(dev, dtype: str, shape: str) -> None:
    """The int4 sacc builds (the MMAs on the integer weights q - z, the float32 scale on each warp's k-tile partial)
    against a float64 reference of the quantized model itself ((q - z) * s unrounded; act rounded to T as stored):
    per pair |dy| / |y| < 5e-3 and the step < 1e-3, as the exact builds' bound - and no further from it than the
    exact ``reg`` build (whose weights are T((q - z) * s): one more rounding), over every variant and step of
    test_matches_dequantise_then_moe_decode_and_float64 (groups 32 / 64 / 128 / a row, sym / asym; the 256-k builds
    refuse group 32 with the rule, a warp's 64 k in one block, and are skipped there); canaries: nothing written past
    y[:n, :kk] / act[:n*kk], every pair's act row written; the builds of one SACC_GROUPS group (one k split, 16 / 32
    act columns a gate_up CTA) bit for bit equal."""
    from hybrid_runtime.cuda.moe_nbits_decode import shape_problems

    exact, _ = kernels(dev, dtype, "reg")
    r = rig(dev, dtype, shape, 4)
    worst: dict[str, float] = {"reg": 0.0}
    for vi, (group, asym) in enumerate(_variants(shape, 4)):
        r.variant(group, asym, seed=vi)
        rng = np.random.default_rng(vi)
        for n, case, fold in STEPS:
            hb = host_bits(rng.standard_normal((n, r.H)).astype(np.float32), dtype)
            lg = logits_for(rng, n, r.E, r.ld, case)
            kk = r.k + int(fold)
            P = n * kk
            top, w = reference_route(lg, r.E, r.k, fold)
            label = f"{dtype} {shape} int4 g{group} {'asym' if asym else 'sym'} n={n} {case} fold={fold}"
            ref64 = shape == "small" or n == 1  # the 35B shape: 9 experts to dequantise on the host
            want = r.reference(to_f32(hb, r.dtype), top, w, exact=True) if ref64 else None
            step_exact = None
            for names in SACC_GROUPS:
                first = None
                for name in names:
                    moe = kernels(dev, dtype, name)[0]
                    probs = shape_problems(dtype, r.H, r.I, r.gu, r.dn, r.e_all, r.k + 1, knobs=moe.knobs)
                    if probs:  # the 256-k builds on group 32: refused with the rule, never launched
                        assert moe.knobs.bk == 256 and group == 32 and "multiple of 64" in "; ".join(probs), probs
                        continue
                    got = r.run(moe, None, n, hb, lg, fold)
                    assert np.array_equal(got["pe"][:P].reshape(n, kk), top), label
                    assert (got["y"][n:] == CANARY).all() and (got["y"][:n, kk:] == CANARY).all(), (name, label)
                    assert np.isnan(got["act"][P:]).all() and not np.isnan(got["act"][:P]).any(), (name, label)
                    if first is None:
                        first = got
                    else:
                        assert got["y"].tobytes() == first["y"].tobytes(), (name, label)
                        assert got["act"].tobytes() == first["act"].tobytes(), (name, label)
                if first is None or want is None:
                    continue
                pair, step = _rel(first["y"][:n, :kk].astype(np.float64), want)
                if step_exact is None:
                    ex = r.run(exact, None, n, hb, lg, fold)
                    _, step_exact = _rel(ex["y"][:n, :kk].astype(np.float64), want)
                    worst["reg"] = max(worst["reg"], step_exact)
                worst[names[0]] = max(worst.get(names[0], 0.0), step)
                assert pair < 5e-3 and step < 1e-3, (label, names[0], pair, step)
                assert step <= step_exact, (label, names[0], "further from the quantized model than reg", step,
                                            step_exact)
    print(f"\n[moe_nbits] sacc {dtype} {shape} int4: worst step |y - quantized model| / |model| "
          + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
          + f"; groups {' | '.join(', '.join(g) for g in SACC_GROUPS)} bit-identical within a group")


@pytest.mark.parametrize("group", range(len(SACC_GROUPS)))
def test_scale_on_accumulator_builds_are_batch_invariant(dev, group: int) -> None:
    """Batch invariance on the 35B shape (_check_batch_invariance, group size 128) of each group of int4 sacc
    builds."""
    _check_batch_invariance(dev, 4, SACC_GROUPS[group])
