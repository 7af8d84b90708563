"""Weight-only int4 / int8 decode GEMMs (W4A16 / W8A16, 1..16 rows) on tensor cores straight from the packed
MatMulNBits weights (``ops/cuda/nbits_decode.cu``): the weights are read once, dequantised in registers.

The operand (:class:`NBitsOperand`, device pointers) is :class:`hybrid_runtime.quant.NBitsWeight` on the device,
for one linear of output width N, input width k_in and op width K (K >= k_in after act-order padding), block size
bs, nb = K / bs blocks per row:

* ``B`` uint8 ``[N, nb, bs * bits / 8]`` (a row's K codes contiguous; 4-bit: two per byte, the low nibble first);
* ``scales`` float32 ``[N, nb]``;
* ``zp`` uint8 ``[N, ceil(nb / 2)]`` (4-bit, low nibble first along the blocks) or ``[N, nb]`` (8-bit), or 0:
  every zero-point is ``2^(bits-1)``;
* ``perm`` int32 ``[K]`` or 0: op column k reads input column ``perm[k]``, ``k_in`` naming a zero column; 0 means
  the identity (then K == k_in);
* ``w[n, k] = (q[n, k] - z[n, k // bs]) * scales[n, k // bs]``.

``out[j, r] = x[j] . w[r] (+ bias[r]) (+ R[j, r])`` for ``j < n <= 16``: x T ``[n, ldx]`` (the input's k_in
columns), bias float32 ``[N]``, R float32 ``[n, ldr]`` (may be ``out`` itself: D = C in place), out float32 or T
``[n, ldo]``: the interface of :class:`hybrid_runtime.cuda.dense_decode.DenseDecode`, float32 accumulation. Grid
``(ceil(N / rows), 1, 1)`` with ``rows`` 16 (``nb_gemm_m16``) or 32 (``nb_gemm_m32``; ``_perm``: the act-order
builds, which gather x through ``perm``), block ``32 *``
:func:`warps_for` warps splitting K; one guarded, programmatic-dependent launch whose first weight, scale and
zero-point loads go out before it waits for the kernel ahead of it.

Batch invariance by construction: an output element's accumulation order depends on (K, bits, warps) only, never
on n (tests/gpu/test_nbits_decode_gpu.py checks a row's bits alone and inside a 16-row step).

Dequantisation (the build's ``exact``; 8-bit always runs the exact path): True rounds ``(q - z) * s`` computed in
float32 once to T, the very T weight a dequantise-at-load path holds; False (the default for 4-bit) makes ``q - z``
exactly in T (the magic-exponent trick) and multiplies it by the scale rounded to T in packed T arithmetic, about
two thirds of the instructions per weight (the main loop's SASS, NVRTC 13: ~4.9 against ~7.4 per int4 code; to keep
up with HBM an SM must dequantise ~30 int4 codes per clock at 4 warp instructions per clock, so the exact path is
instruction-bound at 4 bits; 8-bit codes come half as fast and always take it, ~6.7 per code). In
float16 both give the same bits for float16-valued scales (GPTQ's); in bfloat16 the fast path rounds the scale to
bfloat16 first (a relative error of at most 2^-8 per block scale on top of the weight's own rounding).

The ``sacc`` builds (4-bit, not ``exact``; :attr:`NBitsKnobs.sacc`) put the scale on the accumulator instead: the
MMAs multiply the integer weights ``q - z`` (exact in T) by the activations and each super-step's float32 partial
is scaled once, ``acc += s * sum_k (q - z) x``: no T rounding of weight or scale (closer to the quantized model
than either dequantisation; other bits than both) and one packed multiply fewer per pair of codes (the main loop's
SASS, NVRTC 13, bf16, 16 rows, one n-group: 925 instructions against 1318). A super-step adds the k of 128 codes
in one MMA chain, so these builds need a block size that is a multiple of 128 (GPTQ's 128 and whole-row groups):
:meth:`NBitsKnobs.resolve` gives other operands the build without it (``launch`` applies it), and 8-bit weights run
the exact path as always.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .driver import CudaDevice, DeviceArray, graph_replay_seconds
from .kernels import Module, load_module

SOURCE = "nbits_decode.cu"
DT_CODES = {"float16": 1, "bfloat16": 2}
BITS = (4, 8)
MAX_ROWS = 16
MAX_WARPS = 8
CHUNK = 16  # bytes of a row one lane loads at once
SACC_BLOCK = 128  # the sacc builds' block sizes are multiples of this: the codes of one super-step (4 lanes' chunks)
SHAPE_RULES = ("bfloat16 or float16; bits 4 or 8; block size a multiple of 16 dividing K; K * bits / 8 a multiple of "
               "16 (4-bit: K % 32 == 0); B 16-byte, scales and perm 4-byte aligned; without perm K == k_in, ldx % 8 "
               "== 0 and x 16-byte aligned; with perm 1 <= k_in <= K; ldx >= k_in; 1 <= n <= 16")


@dataclass(frozen=True)
class NBitsKnobs:
    """One build: ``u`` super-steps (a 16-byte chunk per lane and row) per register batch (the 32-row kernels take
    u / 2, at least 1), two batches in flight per warp; ``rows`` weight rows per CTA (16 or 32); ``exact`` the
    4-bit dequantisation (module docstring); ``xpre``: a register batch's activation (x) fragments loaded at its top,
    before its first dequantisation (else per super-step; the same bits either way); ``pf``: super-steps of a
    warp's share past its first register batch prefetched into L2 before the programmatic wait (the 16-row kernels
    without act order; the same bits);
    ``bytes_per_warp``: bytes of a weight row per warp the host aims for (:func:`warps_for`); ``sacc``: the scale
    on the accumulator (module docstring; 4-bit weights whose block size is a multiple of :data:`SACC_BLOCK`, see
    :meth:`resolve`; not with ``exact``)."""

    u: int = 2
    rows: int = 16
    exact: bool = False
    bytes_per_warp: int = 256
    xpre: bool = False
    pf: int = 0
    sacc: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not 1 <= self.u <= 8:
            problems.append(f"u {self.u} not in 1..8")
        if self.rows not in (16, 32):
            problems.append(f"rows {self.rows} not 16 or 32")
        if not 0 <= self.pf <= 64:
            problems.append(f"pf {self.pf} not in 0..64")
        if self.bytes_per_warp < 64 or self.bytes_per_warp % 64:
            problems.append(f"bytes_per_warp {self.bytes_per_warp}: a positive multiple of 64")
        if self.sacc and self.exact:
            problems.append("sacc (the scale on the accumulator) and exact are two different dequantisations")
        if problems:
            raise ValueError("nbits_decode knobs: " + "; ".join(problems))

    def runs_sacc(self, bits: int, block_size: int) -> bool:
        """Whether this build puts the scale on the accumulator for such weights (4-bit, block size a multiple of
        :data:`SACC_BLOCK`)."""
        return self.sacc and bits == 4 and block_size > 0 and block_size % SACC_BLOCK == 0

    def resolve(self, bits: int, block_size: int) -> NBitsKnobs:
        """The build that runs ``bits``-bit weights of ``block_size``: this one, or without ``sacc`` where the
        scale on the accumulator does not apply (8-bit, or blocks that split a super-step's 128 codes)."""
        return self if not self.sacc or self.runs_sacc(bits, block_size) else replace(self, sacc=False)

    def options(self, dtype: str, bits: int) -> tuple[str, ...]:
        """NVRTC options for ``dtype`` / ``bits`` (a sacc build at 8 bits compiles without it: the exact path)."""
        return (f"-DDT={DT_CODES[dtype]}", f"-DNB_BITS={bits}", f"-DNB_U={self.u}", f"-DNB_EXACT={int(self.exact)}",
                f"-DNB_XPRE={int(self.xpre)}", f"-DNB_PF={self.pf}", f"-DNB_SACC={int(self.sacc and bits == 4)}")

    def kernel(self, perm: bool = False) -> str:
        return ("nb_gemm_m16" if self.rows == 16 else "nb_gemm_m32") + ("_perm" if perm else "")

    def same_bits(self, other: NBitsKnobs, bits: int, block_size: int = SACC_BLOCK) -> bool:
        """Whether ``other`` gives this build's bits for ``bits``-bit weights of ``block_size``: the same split of
        K and, at 4 bits, the same dequantisation (8-bit always runs the exact one; see :meth:`resolve` for sacc);
        u, rows, xpre and pf never change a result."""
        a, b = self.resolve(bits, block_size), other.resolve(bits, block_size)
        return a.bytes_per_warp == b.bytes_per_warp and (bits == 8 or (a.exact, a.sacc) == (b.exact, b.sacc))


DEFAULT_KNOBS = NBitsKnobs()
# The builds the benchmark compares. bpw128 / bpw512 split K in twice / half as many warps as the default (other
# sums); all the others split it alike and, but for exact, dequantise alike: the same bits as the default.
KNOB_SETS: dict[str, NBitsKnobs] = {
    "default": DEFAULT_KNOBS,
    "exact": NBitsKnobs(exact=True),
    "u1": NBitsKnobs(u=1),
    "m32": NBitsKnobs(rows=32),
    "xpre": NBitsKnobs(xpre=True),
    "pf8": NBitsKnobs(pf=8),
    "bpw128": NBitsKnobs(bytes_per_warp=128),
    "bpw512": NBitsKnobs(bytes_per_warp=512),
    "sacc": NBitsKnobs(sacc=True),
    "sacc_m32": NBitsKnobs(rows=32, sacc=True),
}
# The primary build CudaBackend runs the packed projections with (its load-time tuning candidates carry its
# dequantisation, :func:`tune_candidates`): the scale on the accumulator, which :meth:`NBitsKnobs.resolve` turns
# into the fast build for 4-bit blocks that are not multiples of SACC_BLOCK and into the exact path for 8-bit
# weights. Timed against the fast build on an H100 (benchmarks/results/gpu_nbits_decode_h200.md "Stop 53"): the
# tuned sacc builds take 0.85-0.87x its time on the 35B-A3B projections at 1 and 8 rows, and the int4 step 0.98x.
BACKEND_KNOBS: NBitsKnobs = KNOB_SETS["sacc"]
# The builds :meth:`NBitsDecode.tune` times per shape at load: the primary's split of K and dequantisation
# (:func:`tune_candidates`), so whichever wins, every output element has the same bits.
TUNE_SETS: tuple[str, ...] = ("default", "u1", "m32", "xpre", "pf8")


def _with_bits_of(kn: NBitsKnobs, primary: NBitsKnobs) -> NBitsKnobs:
    return replace(kn, exact=primary.exact, sacc=primary.sacc, bytes_per_warp=primary.bytes_per_warp)


def tune_candidates(primary: NBitsKnobs) -> list[NBitsKnobs]:
    """:data:`TUNE_SETS` with ``primary``'s dequantisation (exact, sacc) and split of K: the same bits."""
    return [_with_bits_of(KNOB_SETS[n], primary) for n in TUNE_SETS]


def build_name(kn: NBitsKnobs) -> str:
    """A build's name for logs: its :data:`KNOB_SETS` name, else a tuning set's name with the dequantisation it
    was given (``"m32 (sacc, bpw 256)"``), else the knobs."""
    for name, k in KNOB_SETS.items():
        if k == kn:
            return name
    for name in TUNE_SETS:
        if _with_bits_of(KNOB_SETS[name], kn) == kn:
            return f"{name} ({'sacc' if kn.sacc else 'exact' if kn.exact else 'fast'}, bpw {kn.bytes_per_warp})"
    return repr(kn)


def row_bytes(K: int, bits: int) -> int:
    return K * bits // 8


def warps_for(K: int, bits: int, knobs: NBitsKnobs = DEFAULT_KNOBS) -> int:
    """Warps per CTA: a row's packed bytes / bytes_per_warp, clamped to 1..8 (fixed per shape: the bits do not
    depend on n). The default 256 bytes: 4 warps of 4 super-steps (64 bytes of a row each) for a 2048-column int4
    row; bpw128 gives 8 warps of 2, a warp's whole share in the one register batch loaded before the programmatic
    wait (half the bytes in flight per warp, twice the warps)."""
    return max(1, min(MAX_WARPS, row_bytes(K, bits) // knobs.bytes_per_warp))


def grid(N: int, knobs: NBitsKnobs = DEFAULT_KNOBS) -> tuple[int, int, int]:
    return (-(-N // knobs.rows), 1, 1)


def bs_shift(block_size: int) -> int:
    """log2(block_size) for a power of two (the kernel shifts), else -1 (it divides)."""
    return block_size.bit_length() - 1 if block_size > 0 and block_size & (block_size - 1) == 0 else -1


@dataclass(frozen=True)
class NBitsOperand:
    """One quantized linear on the device (pointers; 0 = absent): see the module docstring for the layout."""

    B: int
    scales: int
    zp: int
    perm: int
    K: int
    N: int
    bits: int
    block_size: int
    k_in: int

    @classmethod
    def from_arrays(cls, B: DeviceArray, scales: DeviceArray, zp: DeviceArray | None, perm: DeviceArray | None,
                    meta: Any) -> NBitsOperand:
        """The operand of one weight's device arrays (the state weights ``<w>.nbits_B`` / ``_scales`` / ``_zp`` /
        ``_perm`` as the loader puts them on the device) and its ``nbits_meta`` ``[K, N, bits, block_size,
        accuracy_level, k_in]``. ValueError when an array's dtype or size does not fit the layout."""
        K, N, bits, bs, _, k_in = (int(v) for v in meta)
        nb = K // bs if bs > 0 and K % bs == 0 else -1
        want = {"B": (B, "uint8", N * row_bytes(K, bits)), "scales": (scales, "float32", N * nb)}
        if zp is not None:
            want["zp"] = (zp, "uint8", N * ((nb + 1) // 2 if bits == 4 else nb))
        if perm is not None:
            want["perm"] = (perm, "int32", K)
        bad = [f"{name}: {a.dtype.name} x {a.size}, want {dt} x {size}" for name, (a, dt, size) in want.items()
               if a.dtype.name != dt or a.size != size]
        if nb < 1:
            bad.insert(0, f"block size {bs} does not divide K {K}")
        if bad:
            raise ValueError(f"nbits operand [N {N}, K {K}, {bits}-bit, block {bs}]: " + "; ".join(bad))
        return cls(B.ptr, scales.ptr, zp.ptr if zp is not None else 0, perm.ptr if perm is not None else 0, K, N,
                   bits, bs, k_in)

    @classmethod
    def from_packed(cls, p: Any) -> NBitsOperand:
        """The operand of one packed weight the loader keeps on the device (``cuda.quant.PackedLinear``)."""
        return cls(p.B.ptr, p.scales.ptr, p.zp.ptr if p.zp is not None else 0, p.perm.ptr if p.perm is not None else 0,
                   p.K, p.N, p.bits, p.block_size, p.k_in)

    @property
    def nbytes(self) -> int:
        """Bytes one call reads of the weight: packed codes, scales and zero-points (the decode floor's bytes)."""
        nb = self.K // self.block_size if self.block_size else 0
        zb = 0 if not self.zp else self.N * ((nb + 1) // 2 if self.bits == 4 else nb)
        return self.N * row_bytes(self.K, self.bits) + 4 * self.N * nb + zb + (4 * self.K if self.perm else 0)


def problems(dtype: str, n: int, ldx: int, x_ptr: int, w: NBitsOperand) -> list[str]:
    """Why the kernel cannot run this product (empty: it can); :data:`SHAPE_RULES`."""
    out = []
    if dtype not in DT_CODES:
        out.append(f"dtype {dtype!r} (bfloat16 / float16 only)")
    if not 1 <= n <= MAX_ROWS:
        out.append(f"n {n} not in 1..{MAX_ROWS}")
    if w.bits not in BITS:
        out.append(f"bits {w.bits} (4 or 8 only)")
        return out
    bs, K = w.block_size, w.K
    if w.N < 1:
        out.append(f"N {w.N} < 1")
    if bs < 16 or bs % 16:
        out.append(f"block size {bs}: a multiple of 16 (>= 16)")
    elif bs > K or K % bs:
        out.append(f"K {K} is not a positive multiple of the block size {bs}")
    if K < 1 or row_bytes(K, w.bits) % CHUNK:
        out.append(f"K {K}: a row of {w.bits}-bit codes must be a multiple of {CHUNK} bytes "
                   f"(K % {8 * CHUNK // w.bits} == 0)")
    if K >= 1 << 24:
        out.append(f"K {K} >= 2^24")
    if w.perm:
        if not 1 <= w.k_in <= K:
            out.append(f"k_in {w.k_in} not in 1..K ({K}) with a permutation")
        if w.perm % 4:
            out.append("perm must be 4-byte aligned")
    else:
        if w.k_in != K:
            out.append(f"k_in {w.k_in} != K {K} without a permutation")
        if ldx % 8 or x_ptr % 16:
            out.append(f"without a permutation x must be 16-byte aligned with ldx % 8 == 0 (ldx {ldx})")
    if ldx < w.k_in:
        out.append(f"ldx {ldx} < k_in {w.k_in}")
    if w.B % 16 or not w.B:
        out.append("B must be a 16-byte aligned (non-null) pointer")
    if w.scales % 4 or not w.scales:
        out.append("scales must be a 4-byte aligned (non-null) pointer")
    return out


def check(dtype: str, n: int, ldx: int, x_ptr: int, w: NBitsOperand) -> None:
    """ValueError naming each rule a product breaks."""
    if p := problems(dtype, n, ldx, x_ptr, w):
        raise ValueError("nbits_decode: " + "; ".join(p))


def launch_args(n: int, x: int, ldx: int, w: NBitsOperand, out: int, ldo: int, out_f32: bool, residual: int = 0,
                ldr: int = 0, bias: int = 0) -> list[tuple[str, int]]:
    """The kernel's parameters, in ``NB_PARAMS`` order."""
    return [("ptr", x), ("i64", ldx), ("ptr", w.B), ("ptr", w.scales), ("ptr", w.zp), ("ptr", w.perm), ("i32", w.N),
            ("i32", w.K), ("i32", w.k_in), ("i32", w.block_size), ("i32", bs_shift(w.block_size)), ("i32", n),
            ("ptr", bias), ("ptr", residual), ("i64", ldr), ("ptr", out), ("i64", ldo), ("i32", int(out_f32))]


def pick(times: Mapping[NBitsKnobs, float], primary: NBitsKnobs) -> NBitsKnobs:
    """The fastest build of ``times`` (seconds); ``primary`` on a tie or when it is the only one measured."""
    if not times or times.get(primary, float("inf")) <= min(times.values()):
        return primary
    return min(times, key=lambda kn: times[kn])


class NBitsDecode:
    """The int4 / int8 decode-GEMM kernels for one dtype on one device: the primary build (:class:`NBitsKnobs`,
    one module per bit width, compiled on first use) and the ``candidates`` :meth:`tune` may choose per shape
    instead (each with the primary's split of K and dequantisation: the same bits)."""

    def __init__(self, device: CudaDevice, dtype: str, knobs: NBitsKnobs = DEFAULT_KNOBS,
                 candidates: Sequence[NBitsKnobs] = ()) -> None:
        if dtype not in DT_CODES:
            raise ValueError(f"the int4 / int8 decode GEMM runs bfloat16 / float16, not {dtype!r}")
        if bad := [c for c in candidates if (c.bytes_per_warp, c.exact, c.sacc) != (knobs.bytes_per_warp, knobs.exact,
                                                                                   knobs.sacc)]:
            raise ValueError(f"nbits_decode candidates {bad} split K or dequantise differently from {knobs}: their "
                             "results would not have the same bits")
        self.device, self.dtype, self.knobs = device, dtype, knobs
        self.builds: tuple[NBitsKnobs, ...] = tuple(dict.fromkeys([knobs, *candidates]))
        self.modules: dict[tuple[NBitsKnobs, int], Module] = {}
        self.choice: dict[tuple[int, int, int], NBitsKnobs] = {}  # (N, K, bits) -> the build tune() picked

    def module(self, bits: int, knobs: NBitsKnobs | None = None) -> Module:
        """The build ``knobs`` (default: the primary; as :meth:`NBitsKnobs.resolve` gave it for the operand) for
        ``bits``, compiled and loaded on first use (a sacc build at 8 bits is its twin without sacc: one module)."""
        kn = (knobs or self.knobs).resolve(bits, SACC_BLOCK)
        if (kn, bits) not in self.modules:
            self.modules[(kn, bits)] = load_module(SOURCE, kn.options(self.dtype, bits), self.device.arch)
        return self.modules[(kn, bits)]

    def prepare(self, ops: Sequence[NBitsOperand]) -> list[tuple[NBitsKnobs, int]]:
        """Compile and load now (never during a graph capture) the primary build each of ``ops`` runs: one module
        per (resolved build, bits), e.g. a sacc primary and its twin without sacc for blocks that are not multiples
        of :data:`SACC_BLOCK`. Returns the (build, bits) pairs, in order. The tuning candidates compile in
        :meth:`tune`, which runs before any capture too."""
        need = dict.fromkeys((self.knobs.resolve(w.bits, w.block_size), w.bits)
                             for w in sorted(ops, key=lambda w: (w.bits, w.block_size)))
        for kn, bits in need:
            self.module(bits, kn)
        return list(need)

    def knobs_for(self, N: int, K: int, bits: int) -> NBitsKnobs:
        return self.choice.get((N, K, bits), self.knobs)

    def tune(self, shapes: Mapping[tuple[int, int, int], Sequence[NBitsOperand]], x: int, ldx: int, out: int,
             rows: Sequence[int] = (1,), reps: int = 2) -> dict[tuple[int, int, int], dict[NBitsKnobs, float]]:
        """Time every build on each shape and keep the fastest in :attr:`choice`, as ``DenseDecode.tune``.
        ``shapes``: (N, K, bits) -> the operands of that shape (a model's layers: one call per weight, rotating, so
        the stream comes from memory as in a step); ``x`` (T ``[16, ldx]``, 16-byte aligned, ldx % 8 == 0 and >=
        every k_in) and ``out`` (float32 ``[16, max N]``): scratch device buffers. Each build's calls are captured
        in a CUDA graph and its replay timed with events (no host launch cost in the figure), summed over ``rows``.
        Returns the seconds per call of every (shape, build)."""
        dev, result = self.device, {}
        for (N, K, bits), ops in shapes.items():
            times: dict[NBitsKnobs, float] = {}
            for kn in self.builds:
                def body(kn: NBitsKnobs = kn, ops: Sequence[NBitsOperand] = ops) -> None:
                    for n in rows:
                        for w in ops:
                            self.launch(n, x, ldx, w, out, w.N, True, knobs=kn)

                body()  # compiles and loads the build, checks every launch
                times[kn] = graph_replay_seconds(dev, body, reps) / (len(ops) * len(rows))
            self.choice[(N, K, bits)] = pick(times, self.knobs)
            result[(N, K, bits)] = times
        return result

    def launch(self, n: int, x: int, ldx: int, w: NBitsOperand, out: int, ldo: int, out_f32: bool,
               residual: int = 0, ldr: int = 0, bias: int = 0, knobs: NBitsKnobs | None = None) -> None:
        """``out = x @ w.T (+ bias) (+ residual)`` on n rows (device pointers; shapes in the module docstring) with
        the build ``knobs`` (default: the one :meth:`tune` chose for the shape, else the primary). ValueError
        before any launch for a product :func:`check` refuses; the launch itself passes the guard
        (``Kernel.launch``)."""
        check(self.dtype, n, ldx, x, w)
        kn = (knobs or self.knobs_for(w.N, w.K, w.bits)).resolve(w.bits, w.block_size)
        self.module(w.bits, kn).kernel(kn.kernel(bool(w.perm))).launch(
            self.device, grid(w.N, kn), (32 * warps_for(w.K, w.bits, kn), 1, 1), 0,
            launch_args(n, x, ldx, w, out, ldo, out_f32, residual, ldr, bias), pdl=True)
