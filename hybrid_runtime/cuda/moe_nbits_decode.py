"""The MoE of decode steps over int4 / int8 experts (``ops/cuda/moe_nbits_decode.cu``): :mod:`.moe_decode`'s two
launches, routing contract, grids and output layout, with the experts' weights read PACKED (onnxruntime's
MatMulNBits layout, :class:`hybrid_runtime.quant.NBitsWeight`) - 4x (int4) / 2x (int8) fewer weight bytes from DRAM
than the bf16 experts.

Operands (:class:`NBitsExperts`, device pointers): E_all experts of R rows and K columns stacked on axis 0, the same
bits and block size bs for all of them, ``K % bs == 0``, no act order (``perm``; refused: a first version):

* ``B`` uint8 ``[E_all * R, K * bits / 8]`` (codes along K; 4-bit two a byte, the low nibble first);
* ``scales`` float32 ``[E_all * R, nb]``, nb = K / bs;
* ``zp`` uint8 ``[E_all * R, ceil(nb / 2)]`` (4-bit, low nibble first) or ``[E_all * R, nb]`` (8-bit), or 0: every
  zero-point is ``2^(bits-1)``.

gate_up: R = 2I (rows 0..I-1 gate, I..2I-1 up), K = H; down: R = H, K = I. :func:`stack_experts` /
:func:`fuse_rows` build these arrays on the host from per-expert (or per-part) packed weights; the shared expert is
folded in as expert E like :mod:`.moe_decode`'s.

Each k tile of a CTA's weight rows goes packed through the cp.async ring. The first builds (``reg`` 0) dequantise it
in shared memory into moe_decode's bf16 / fp16 staged tile, ``T((q - z) * s)`` in float32 rounded once (nbits.cu's
dequantise-at-load weights, bit for bit), and run moe_decode's mma loop on it unchanged; the ``reg`` 1 builds
dequantise each lane's own codes straight into its mma A fragments (the same slots and T values ldmatrix reads from
that tile; no tile, one barrier per k tile). Every act / y element therefore has moe_decode's bits on the dequantised
weights for the same ``bk`` and ``warps``, whichever ``reg``, and moe_decode's batch invariance carries over.

int4 operands whose scales are all "short" (:func:`short_scales`: at most 12 significant bits, as the float16 /
bfloat16 scales of GPTQ checkpoints are) run the ``reg`` builds compiled with ``-DMN_FMA=1``: each weight one FFMA
on the code placed in a float's mantissa by a byte permute, instead of shift, mask, FADD and FMUL - the same float32
value ``(q - z) * s`` (the kernel's header proves it), so the same bits; any other scale keeps the FADD + FMUL path.

The ``sacc`` builds (:data:`SACC_SETS`, int4 only: ``-DMN_SACC=1``) give up those bits for half the instructions a
weight: the MMAs multiply the integer weights ``q - z`` (exact in bf16 / fp16, two codes to a T pair per LOP3 + HFMA2)
by the activations, and each warp's float32 partial of a k tile is scaled once, ``acc += s * sum_k (q - z) x``. That
is closer to the quantized model than the dequantised T weights (one rounding fewer), batch invariant as the others,
but not their bits. They need a block size that is a multiple of a warp's k of one k tile (32 for bk 128 and 4
warps: GPTQ's 32 / 64 / 128 / whole-row groups; 64 for the 256-k tile builds, whose k tiles carry a tile's fixed
cost over twice the weights); :func:`backend_build` runs a 256-k build's :data:`K128_TWIN` where its rule fails, and a
128-k build's :data:`EXACT_TWIN`. Their int8 modules are the exact reg build's (the 256-k builds have none: int8 runs
their 128-k twin).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np

from .driver import CudaDevice
from .kernels import Module, load_module
from .moe_decode import DT_CODES, MAX_EXPERTS, DecodeKnobs, groups_per_pass, ny_grid
from .moe_prefill import MoEBuffers

SOURCE = "moe_nbits_decode.cu"
WIDE_BK = 256  # the k tile of the sacc builds that amortise a tile's fixed cost over twice the weights
BITS = (4, 8)
GROUP = 8  # pairs per mma n-tile
SMEM_LIMIT = 227 * 1024  # opt-in dynamic shared memory per CTA (H200)
SHAPE_RULES = ("bfloat16 or float16; bits 4 or 8, the same for gate_up and down; H % 64 == 0, I % 64 == 0; block "
               "size a multiple of 16 dividing K (H for gate_up, I for down); no act order; 1 <= E_all <= 1024; "
               "16-byte aligned B and h rows (ldh % 8 == 0), 4-byte aligned scales")


@dataclass(frozen=True)
class NBitsKnobs:
    """One build of ``moe_nbits_decode.cu``: moe_decode's knobs without its early / prefetch / dn_pre variants.
    ``gu_cols`` act columns per gate_up CTA; ``dn_rows`` y rows per down CTA; ``gu_stages`` / ``dn_stages`` ring
    depths; ``bk`` k per stage; ``gmax`` groups of 8 pairs per pass; ``warps``; ``reg`` 0: dequantise each staged k
    tile into a T tile in shared memory, 1: into the lanes' mma A fragments in registers (``-DMN_REG=1``); ``early``
    1 (reg builds only): the first pass's prologue weight copies and (scale, zero) loads go out as soon as the expert
    is known, before the pair lists are read. Only ``bk`` and ``warps`` enter a result's accumulation order."""

    gu_cols: int = 16
    gu_stages: int = 6
    dn_rows: int = 64
    dn_stages: int = 4
    bk: int = 128
    gmax: int = 4
    warps: int = 4
    reg: int = 0
    early: int = 0
    sacc: int = 0

    def __post_init__(self) -> None:
        if self.reg not in (0, 1) or self.early not in (0, 1) or self.early > self.reg:
            raise ValueError(f"moe_nbits_decode knobs: reg {self.reg} / early {self.early} not 0 / 1, or early "
                             "without reg")
        if self.sacc not in (0, 1) or self.sacc > self.reg:
            raise ValueError(f"moe_nbits_decode knobs: sacc {self.sacc} not 0 / 1, or sacc without reg")
        if self.bk == WIDE_BK:  # sacc builds only (int4): moe_decode has no such tile; its other rules still hold
            if not self.sacc:
                raise ValueError(f"moe_nbits_decode knobs: bk {WIDE_BK} is a sacc build's (k tiles of 256)")
            if (WIDE_BK // 16) % self.warps:
                raise ValueError(f"moe_nbits_decode knobs: warps {self.warps}: (bk / 16) % warps must be 0")
            replace(self, bk=128).decode_knobs()
        else:
            self.decode_knobs()  # the same rules (ValueError naming the knob)

    @property
    def steps_per_warp(self) -> int:
        """k16 steps of one k tile each warp runs (MD_SPW)."""
        return self.bk // 16 // self.warps

    def scales_acc(self, bits: int) -> bool:
        """Whether this build runs ``bits``-bit experts with the scale on the accumulator (``-DMN_SACC=1``: int4
        ``sacc`` builds; their int8 modules are the exact reg build's, none for a 256-k tile)."""
        return bool(self.sacc and bits == 4)

    def runs_bits(self, bits: int) -> bool:
        """Whether this build has a module for ``bits`` (a 256-k tile is int4 sacc only)."""
        return self.bk != WIDE_BK or bits == 4

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def decode_knobs(self) -> DecodeKnobs:
        """moe_decode's build with the same tiles: the same bits on the dequantised weights (ValueError for a
        256-k tile: none)."""
        if self.bk == WIDE_BK:
            raise ValueError(f"moe_nbits_decode: a {WIDE_BK}-k tile (a sacc build) has no moe_decode twin")
        d = asdict(self)
        del d["reg"], d["early"], d["sacc"]
        return DecodeKnobs(**d)

    def options(self, dtype: str, bits: int, fma: bool = False) -> tuple[str, ...]:
        """NVRTC options of this build for ``dtype`` / ``bits``; ``fma``: the FFMA dequantisation (:func:`uses_fma`:
        int4 ``reg`` builds on short scales only; ValueError otherwise)."""
        if not self.runs_bits(bits):
            raise ValueError(f"moe_nbits_decode: a {WIDE_BK}-k tile runs int4 experts only, not {bits}-bit")
        if fma and not (self.reg and bits == 4 and not self.sacc):
            raise ValueError(f"moe_nbits_decode: the FFMA dequantisation is an int4 reg build's without sacc (bits "
                             f"{bits}, reg {self.reg}, sacc {self.sacc})")
        return (f"-DDT={DT_CODES[dtype]}", f"-DMN_BITS={bits}", f"-DMD_GU_COLS={self.gu_cols}",
                f"-DMD_GU_STAGES={self.gu_stages}", f"-DMD_DN_ROWS={self.dn_rows}", f"-DMD_DN_STAGES={self.dn_stages}",
                f"-DMD_BK={self.bk}", f"-DMD_GMAX={self.gmax}", f"-DMD_WARPS={self.warps}") + (
                    ("-DMN_REG=1",) if self.reg else ()) + (("-DMN_EARLY=1",) if self.early else ()) + (
                    ("-DMN_FMA=1",) if fma else ()) + (("-DMN_SACC=1",) if self.scales_acc(bits) else ())

    def rows(self, kind: str) -> int:
        """Weight rows per CTA of ``kind`` ("gate_up": 2 * gu_cols, "down": dn_rows)."""
        return 2 * self.gu_cols if kind == "gate_up" else self.dn_rows

    def stages(self, kind: str) -> int:
        return self.gu_stages if kind == "gate_up" else self.dn_stages


DEFAULT_KNOBS = NBitsKnobs()
# The builds the benchmark compares (and the compile test checks): name -> knobs. All split K alike (bk 128, 4
# warps): the same bits as the default, and as moe_decode's default on the dequantised weights.
KNOB_SETS: dict[str, NBitsKnobs] = {
    "default": DEFAULT_KNOBS,
    # twice the CTAs: 8 act columns / 32 y rows each (4x fewer bytes a CTA streams than bf16: more CTAs in flight)
    "fine": NBitsKnobs(gu_cols=8, gu_stages=8, dn_rows=32, dn_stages=6),
    # 32 act columns per gate_up CTA, as moe_decode's "many" (steps of many tokens)
    "many": NBitsKnobs(gu_cols=32, gu_stages=4),
    # dequantisation in registers (reg 1): no T tile, so deeper rings for the same shared memory (down's K = I = 512
    # is 4 k tiles: 5 stages hold all of them in flight); early: weights and scales requested before the pair lists
    "reg": NBitsKnobs(gu_stages=8, dn_stages=5, reg=1, early=1),
    "reg_late": NBitsKnobs(gu_stages=8, dn_stages=5, reg=1),  # "reg" without early (what early alone is worth)
    "reg_fine": NBitsKnobs(gu_cols=8, gu_stages=10, dn_rows=32, dn_stages=5, reg=1, early=1),
    "reg_many": NBitsKnobs(gu_cols=32, gu_stages=4, reg=1, early=1),  # "many" in registers (many tokens)
    # one group of 8 pairs per pass (gmax 1): the k-tile loop compiles for one group, no predicated-off MMAs / ldmatrix
    # for the three a step of <= 8 pairs per expert leaves unused (the kernels are issue-bound: stop 37's notes), and
    # each thread's B-row copy (one 16-byte chunk a k tile) is worked out once per pass; an expert with more pairs
    # takes more passes. g1_deep: every gate_up k tile of H = 2048 in flight at once; g2: two groups a pass
    "reg_g1": NBitsKnobs(gu_stages=8, dn_stages=5, reg=1, gmax=1),
    "reg_g1_deep": NBitsKnobs(gu_stages=16, dn_stages=5, reg=1, gmax=1),
    "reg_g2": NBitsKnobs(gu_stages=8, dn_stages=5, reg=1, gmax=2),
    # reg_g1 with 32 act columns per gate_up CTA (two more m-tiles a k tile over the loop's fixed cost)
    "reg_g1_wide": NBitsKnobs(gu_cols=32, gu_stages=8, dn_stages=5, reg=1, gmax=1),
}
# Builds with the scale on the accumulator (sacc 1, int4: module header MN_SACC): half the instructions a weight,
# not the bits of the builds above (int8 runs their exact path). name -> knobs, as KNOB_SETS.
SACC_SETS: dict[str, NBitsKnobs] = {
    "sacc_g1": NBitsKnobs(gu_stages=8, dn_stages=5, reg=1, gmax=1, sacc=1),
    "sacc_g1_deep": NBitsKnobs(gu_stages=16, dn_stages=5, reg=1, gmax=1, sacc=1),
    "sacc_wide": NBitsKnobs(gu_cols=32, gu_stages=8, dn_stages=5, reg=1, gmax=1, sacc=1),
    # k tiles of 256 (4 k16 steps a warp): the tile's fixed cost (ring refill, barrier, table loads) over twice the
    # weights; as many k in flight with half the stages; block sizes a multiple of 64 (others: K128_TWIN). The wide
    # gate_up k-tile loop is 3.6 SASS instructions a weight against sacc_wide's 4.9; on an H100 (stop 52) the MoE of
    # 8 / 64 tokens takes 74.9 / 231.9 us against sacc_wide's 79.2 / 246.4 (0.95x / 0.94x), and the GPU tests
    # (scale_on_accumulator: float64 error, batch invariance) pass
    "sacc_g1_k256": NBitsKnobs(gu_stages=4, dn_stages=3, bk=256, reg=1, gmax=1, sacc=1),
    "sacc_wide_k256": NBitsKnobs(gu_cols=32, gu_stages=4, dn_stages=3, bk=256, reg=1, gmax=1, sacc=1),
}
ALL_SETS: dict[str, NBitsKnobs] = {**KNOB_SETS, **SACC_SETS}
# The builds CudaBackend(packed_experts=True) runs where only the experts are packed (packed_weights experts: the
# dequantised bundle's bits), per bit width: (up to this many rows, build) in order, a step of n rows taking the first
# entry with n <= rows. All KNOB_SETS builds give the same bits, so this is a speed choice only.
# Measured on the H200 (benchmarks/results/gpu_moe_nbits_decode_h200.md, stop 39; float16-valued scales, int4 with the
# FFMA dequantisation): 1 token int4 reg_g1_deep 23.5 us (reg_g1 25.8, reg_late 27.3), int8 reg_late 29.2 (reg_g1
# 30.4, reg_g1_deep 33.8); 2-64 tokens reg_g1 the fastest of every build for both (8 tokens int4 89.9 / int8 94.9 us,
# reg_many 109.8 / 117.8; 64 tokens 310.4 / 316.2, reg_many 369.1 / 390.4).
BACKEND_BUILDS: dict[int, tuple[tuple[int, str], ...]] = {4: ((1, "reg_g1_deep"), (1 << 30, "reg_g1")),
                                                          8: ((1, "reg_late"), (1 << 30, "reg_g1"))}
# The builds of a backend whose dense projections are packed too (packed_weights all / dual, the GPTQ default: their
# decode steps are already not the dequantised bundle's bits): int4 with the scale on the accumulator (sacc: closer to
# the quantized model, fewer instructions a weight), int8 as BACKEND_BUILDS. Measured on an H100 (stop 51,
# gpu_moe_nbits_decode_h200.md): 1 token sacc_g1_deep 21.9 us (reg_g1_deep 24.7), 4 sacc_g1 48.4 (sacc_wide 51.2,
# reg_g1 54.9), 8 / 64 sacc_wide 78.3 / 242.9 (sacc_g1 79.3 / 260.4, reg_g1 90.8 / 303.6); stop 52, same card:
# sacc_wide_k256 74.9 / 231.9 against sacc_wide's 79.2 / 246.4 at 8 / 64 (block sizes that are not a multiple of 64
# run sacc_wide: K128_TWIN). weights.packed_layer_experts checks a layer's shapes against the builds of both tables.
FAST_BUILDS: dict[int, tuple[tuple[int, str], ...]] = {4: ((1, "sacc_g1_deep"), (4, "sacc_g1"),
                                                           (1 << 30, "sacc_wide_k256")),
                                                       8: BACKEND_BUILDS[8]}


# Each 128-k sacc build's exact twin (the same tiles without sacc): what experts whose block size the sacc rule refuses
# run. (A 256-k build resolves through its K128_TWIN first: moe_decode has no 256-k tile.)
EXACT_TWIN: dict[str, str] = {"sacc_g1": "reg_g1", "sacc_g1_deep": "reg_g1_deep", "sacc_wide": "reg_g1_wide"}


# Each 256-k sacc build's 128-k one (the same columns and warps): what a 256-k build falls back to first, for block
# sizes that split its warp's 64 k but not the 128-k build's 32, and for int8 (no 256-k module; the 128-k build runs
# int8 on the exact path).
K128_TWIN: dict[str, str] = {"sacc_g1_k256": "sacc_g1", "sacc_wide_k256": "sacc_wide"}


def resolve_build(name: str, bits: int, block_sizes: Sequence[int] = ()) -> str:
    """``name``, or where it cannot run these experts - a sacc build for ``bits`` whose warp's k of a k tile a
    block size of ``block_sizes`` splits (the sacc rule of :func:`shape_problems`), or a build with no module for
    ``bits`` (a 256-k tile and int8) - its :data:`K128_TWIN` (resolved in turn), else its :data:`EXACT_TWIN`."""
    kn = ALL_SETS[name]
    if not kn.runs_bits(bits) or (kn.scales_acc(bits) and any(bs % (16 * kn.steps_per_warp) for bs in block_sizes)):
        return resolve_build(K128_TWIN[name], bits, block_sizes) if name in K128_TWIN else EXACT_TWIN[name]
    return name


def backend_build(bits: int, n: int, builds: dict[int, tuple[tuple[int, str], ...]] | None = None,
                  block_sizes: Sequence[int] = ()) -> str:
    """The build of ``builds`` (default :data:`BACKEND_BUILDS`) a step of ``n`` rows over ``bits``-bit experts of
    block sizes ``block_sizes`` (gate_up's, down's) runs (:func:`resolve_build`)."""
    table = (BACKEND_BUILDS if builds is None else builds)[bits]
    return resolve_build(next(b for rows, b in table if n <= rows), bits, block_sizes)


@dataclass(frozen=True)
class NBitsExperts:
    """E_all stacked packed experts on the device (pointers; ``zp`` 0 = absent): ``rows`` R and ``K`` per expert,
    the layout of the module docstring."""

    B: int
    scales: int
    zp: int
    e_all: int
    rows: int
    K: int
    bits: int
    block_size: int
    perm: int = 0
    short: bool = False  # every scale short (:func:`short_scales`): int4 reg builds take the FFMA dequantisation

    @classmethod
    def from_packed(cls, p: Any, short: bool = False) -> NBitsExperts:
        """The operand of a stacked packed weight the loader keeps on the device (``cuda.quant.PackedLinear`` with
        ``experts`` > 0); ``short``: :func:`short_scales` of its host scales. ValueError for act order, a row offset
        or unstacked weights."""
        if p.experts < 1 or p.row0 != 0:
            raise ValueError(f"moe_nbits_decode: a stacked weight of whole experts is needed (experts {p.experts}, "
                             f"row0 {p.row0})")
        return cls(p.B.ptr, p.scales.ptr, p.zp.ptr if p.zp is not None else 0, p.experts, p.N, p.K, p.bits,
                   p.block_size, p.perm.ptr if p.perm is not None else 0, short)

    @property
    def n_blocks(self) -> int:
        return self.K // self.block_size if self.block_size > 0 else 0

    def expert_bytes(self) -> int:
        """Bytes of one expert's packed codes, scales and zero-points (what a step reads per expert touched)."""
        nb = self.n_blocks
        zb = 0 if not self.zp else self.rows * ((nb + 1) // 2 if self.bits == 4 else nb)
        return self.rows * self.K * self.bits // 8 + 4 * self.rows * nb + zb


def short_scales(scales: np.ndarray) -> bool:
    """Whether every float32 scale is 0 or a finite value of at most 12 significant bits with ``|s| >= 2^-100``
    (float16 and bfloat16 values are): then ``fma(2^23 + q 2^p, s 2^-p, -(2^(23-p) + z) s)`` (p = 12, 16: the
    kernel's MN_FMA) is exactly the float32 ``(q - z) * s`` for every int4 code q and zero-point z, since s 2^-p and
    (2^(23-p) + z) s (at most 12 + 12 significant bits) are exact in float32. An empty array is short."""
    s = np.ascontiguousarray(scales, np.float32).reshape(-1)
    if not s.size:
        return True
    u = s.view(np.uint32)
    a = np.abs(s)
    return bool(np.all(np.isfinite(s)) and np.all((u & 0xFFF) == 0) and np.all((a == 0) | (a >= 2.0 ** -100)))


def uses_fma(w: NBitsExperts, knobs: NBitsKnobs) -> bool:
    """Whether ``knobs``' build runs ``w`` with the FFMA dequantisation (-DMN_FMA=1): int4, short scales, reg 1, no
    sacc."""
    return bool(w.short and w.bits == 4 and knobs.reg and not knobs.sacc)


def stage_bytes(kind: str, gcap: int, bits: int, knobs: NBitsKnobs = DEFAULT_KNOBS) -> int:
    """One ring stage: the CTA's weight rows packed (bk * bits / 8 bytes each) and 8 * gcap B rows of bk T."""
    return knobs.rows(kind) * knobs.bk * bits // 8 + GROUP * gcap * knobs.bk * 2


def smem_bytes(kind: str, gcap: int, bits: int, n_blocks: int, knobs: NBitsKnobs = DEFAULT_KNOBS,
               fma: bool = False) -> int:
    """Dynamic shared memory of one CTA: the dequantised T tile (rows x bk x 2; ``reg`` 0 builds only), the (scale,
    zero) table (rows x n_blocks x 8, or x 16 for the FFMA dequantisation: ``fma``) and the ring - or the warps'
    partial sums that reuse it after the last k tile, if larger."""
    rows = knobs.rows(kind)
    ring = knobs.stages(kind) * stage_bytes(kind, gcap, bits, knobs)
    red = knobs.warps * (rows // 16) * gcap * 32 * 16
    return (0 if knobs.reg else rows * knobs.bk * 2) + rows * n_blocks * (16 if fma else 8) + max(ring, red)


def grid(kind: str, n: int, kk: int, e_all: int, hidden: int, inter: int,
         knobs: NBitsKnobs = DEFAULT_KNOBS) -> tuple[int, int, int]:
    """Launch grid of ``kind``: (I / gu_cols or H / dn_rows, min(E_all, n * kk), 1), as moe_decode's."""
    if kind == "gate_up":
        return (inter // knobs.gu_cols, ny_grid(n, kk, e_all), 1)
    if kind == "down":
        return (hidden // knobs.dn_rows, ny_grid(n, kk, e_all), 1)
    raise ValueError(f"kind {kind!r}: 'gate_up' or 'down'")


def bs_shift(block_size: int) -> int:
    """log2(block_size) for a power of two (the kernel shifts), else -1 (it divides)."""
    return block_size.bit_length() - 1 if block_size > 0 and block_size & (block_size - 1) == 0 else -1


def shape_problems(dtype: str, hidden: int, inter: int, gu: NBitsExperts, dn: NBitsExperts, e_all: int, kk: int,
                   ldh: int | None = None, ny: int | None = None, knobs: NBitsKnobs = DEFAULT_KNOBS,
                   gcap: int | None = None) -> list[str]:
    """Why these kernels cannot run this step (empty: they can); :data:`SHAPE_RULES`, ``gu`` / ``dn`` of E_all
    experts of [2I, H] / [H, I], the shared memory of the largest launch (``gcap``: default ``knobs.gmax``) within
    the per-CTA limit."""
    out = []
    if dtype not in DT_CODES:
        out.append(f"dtype {dtype!r} (bfloat16 / float16 only)")
    if hidden < 64 or inter < 64 or hidden % 64 or inter % 64:
        out.append(f"H {hidden}, I {inter}: both positive multiples of 64")
    if hidden % knobs.dn_rows or inter % knobs.gu_cols:
        out.append(f"H {hidden} % dn_rows {knobs.dn_rows} or I {inter} % gu_cols {knobs.gu_cols} != 0")
    if not 1 <= e_all <= MAX_EXPERTS:
        out.append(f"E_all {e_all}: needs 1 <= E_all <= {MAX_EXPERTS}")
    if not 1 <= kk <= 32:
        out.append(f"kk {kk}: needs 1 <= kk <= 32")
    if ldh is not None and (ldh < hidden or ldh % 8):
        out.append(f"ldh {ldh}: needs ldh >= H and ldh % 8 == 0")
    if ny is not None and ny < kk:
        out.append(f"ny {ny}: needs ny >= kk {kk}")
    if gu.bits != dn.bits:
        out.append(f"gate_up is {gu.bits}-bit, down {dn.bits}-bit: one build runs one bit width")
    for name, w, rows, K in (("gate_up", gu, 2 * inter, hidden), ("down", dn, hidden, inter)):
        where = f"{name} [{w.e_all} x {w.rows} x {w.K}, {w.bits}-bit, block {w.block_size}]"
        if w.bits not in BITS:
            out.append(f"{where}: bits must be 4 or 8")
        if (w.rows, w.K) != (rows, K):
            out.append(f"{where}: each expert must be [{rows}, {K}]")
        if w.e_all < e_all:
            out.append(f"{where}: fewer than E_all {e_all} experts")
        bs = w.block_size
        if bs < 16 or bs % 16:
            out.append(f"{where}: block size must be a multiple of 16")
        elif w.K % bs:
            out.append(f"{where}: block size must divide K {w.K}")
        if w.bits in BITS and not knobs.runs_bits(w.bits):
            out.append(f"{where}: a {WIDE_BK}-k tile build runs int4 experts only")
        if knobs.scales_acc(w.bits) and bs >= 16 and bs % (16 * knobs.steps_per_warp):
            out.append(f"{where}: the scale-on-accumulator build needs a block size that is a multiple of "
                       f"{16 * knobs.steps_per_warp} (a warp's k of one k tile)")
        if w.perm:
            out.append(f"{where}: act order (g_idx / desc_act) is not supported for packed experts yet; keep these "
                       "experts dequantised (packed_experts off)")
        if w.B % 16 or not w.B:
            out.append(f"{where}: B must be a 16-byte aligned (non-null) pointer")
        if w.scales % 4 or not w.scales:
            out.append(f"{where}: scales must be a 4-byte aligned (non-null) pointer")
        if w.bits in BITS and bs >= 16 and w.K % bs == 0 and not out:
            need = smem_bytes(name, knobs.gmax if gcap is None else gcap, w.bits, w.K // bs, knobs,
                              uses_fma(w, knobs))
            if need > SMEM_LIMIT:
                out.append(f"{where}: {need} bytes of shared memory per CTA > {SMEM_LIMIT} (a larger block size)")
    return out


def check_shape(dtype: str, hidden: int, inter: int, gu: NBitsExperts, dn: NBitsExperts, e_all: int, kk: int,
                ldh: int | None = None, ny: int | None = None, knobs: NBitsKnobs = DEFAULT_KNOBS) -> None:
    """ValueError naming every rule of :func:`shape_problems` a step breaks."""
    if p := shape_problems(dtype, hidden, inter, gu, dn, e_all, kk, ldh, ny, knobs):
        raise ValueError("moe_nbits_decode: " + "; ".join(p))


class MoENBitsDecode:
    """The packed-expert decode MoE kernels of one build (:class:`NBitsKnobs`) for one dtype on one device; one
    module per bit width, compiled on first use."""

    def __init__(self, device: CudaDevice, dtype: str, knobs: NBitsKnobs = DEFAULT_KNOBS) -> None:
        if dtype not in DT_CODES:
            raise ValueError(f"the packed-expert decode MoE runs bfloat16 / float16, not {dtype!r}")
        self.device, self.dtype, self.knobs = device, dtype, knobs
        self.modules: dict[tuple[int, bool], Module] = {}

    def module(self, bits: int, fma: bool = False) -> Module:
        """The build for ``bits`` (``fma``: with the FFMA dequantisation, :func:`uses_fma`), compiled, loaded and
        opted in to all the dynamic shared memory the device allows on first use (a launch's own size varies with
        the block count; the opt-in is only a cap). Callers that capture CUDA graphs call it before capturing
        (``CudaBackend`` does at load, for every (bits, fma) its operands take)."""
        if (bits, fma) not in self.modules:
            m = load_module(SOURCE, self.knobs.options(self.dtype, bits, fma), self.device.arch)
            for name in ("moe_nb_gate_up", "moe_nb_down"):
                m.kernel(name).set_max_dynamic_smem(self.device)
            self.modules[(bits, fma)] = m
        return self.modules[(bits, fma)]

    def module_for(self, w: NBitsExperts) -> Module:
        """The module that runs operand ``w`` (its bits; the FFMA build where :func:`uses_fma`)."""
        return self.module(w.bits, uses_fma(w, self.knobs))

    def _kernel(self, w: NBitsExperts, kind: str) -> Any:
        return self.module_for(w).kernel("moe_nb_gate_up" if kind == "gate_up" else "moe_nb_down")

    def launch(self, n: int, h: int, ldh: int, gu: NBitsExperts, dn: NBitsExperts, hidden: int, inter: int,
               kk: int, ny: int, e_all: int, bufs: MoEBuffers, parts: str = "both") -> None:
        """The routed experts of a step after routing, as :meth:`.moe_decode.MoEDecode.launch` with packed
        weights: h (T ``[n, ldh]``) -> ``bufs.act`` (T ``[n*kk, I]``), ``bufs.y`` (float32 ``[n, ny, H]``: slots
        ``kk .. ny-1`` untouched), reading ``bufs.pair_w``, ``pair_list``, ``expert_off``, ``active``. ValueError
        before any launch for a step :func:`check_shape` refuses; ``parts``: "both", "gate_up" or "down"."""
        check_shape(self.dtype, hidden, inter, gu, dn, e_all, kk, ldh, ny, self.knobs)
        if parts not in ("both", "gate_up", "down"):
            raise ValueError(f"parts {parts!r}: 'both', 'gate_up' or 'down'")
        kn = self.knobs
        gcap = groups_per_pass(n, kn.gmax)
        if parts in ("both", "gate_up"):
            smem = smem_bytes("gate_up", gcap, gu.bits, gu.n_blocks, kn, uses_fma(gu, kn))
            self._kernel(gu, "gate_up").launch(
                self.device, grid("gate_up", n, kk, e_all, hidden, inter, kn), (kn.threads, 1, 1), smem,
                [("ptr", h), ("i64", ldh), ("ptr", gu.B), ("ptr", gu.scales), ("ptr", gu.zp),
                 ("i32", gu.block_size), ("i32", bs_shift(gu.block_size)), ("i32", hidden), ("i32", inter),
                 ("i32", kk), ("i32", e_all), ("i32", gcap), ("ptr", bufs.expert_off), ("ptr", bufs.pair_list),
                 ("ptr", bufs.active), ("ptr", bufs.act)], pdl=True)
        if parts in ("both", "down"):
            smem = smem_bytes("down", gcap, dn.bits, dn.n_blocks, kn, uses_fma(dn, kn))
            self._kernel(dn, "down").launch(
                self.device, grid("down", n, kk, e_all, hidden, inter, kn), (kn.threads, 1, 1), smem,
                [("ptr", bufs.act), ("ptr", dn.B), ("ptr", dn.scales), ("ptr", dn.zp), ("i32", dn.block_size),
                 ("i32", bs_shift(dn.block_size)), ("ptr", bufs.pair_w), ("i32", hidden), ("i32", inter),
                 ("i32", kk), ("i32", ny), ("i32", e_all), ("i32", gcap), ("ptr", bufs.expert_off),
                 ("ptr", bufs.pair_list), ("ptr", bufs.active), ("ptr", bufs.y)], pdl=True)


# ------------------------------------------------------------------------------------------- host stacking


@dataclass(frozen=True)
class HostExperts:
    """Stacked packed experts on the host: ``B`` uint8 ``[E, R, K * bits / 8]``, ``scales`` float32 ``[E, R, nb]``,
    ``zp`` uint8 ``[E, R, zrow]`` or None (the kernel's layout, module docstring)."""

    B: np.ndarray
    scales: np.ndarray
    zp: np.ndarray | None
    rows: int
    K: int
    bits: int
    block_size: int

    @property
    def experts(self) -> int:
        return int(self.B.shape[0])

    @cached_property
    def short(self) -> bool:
        """:func:`short_scales` of :attr:`scales` (computed once: the load's shape check and upload both ask)."""
        return short_scales(self.scales)


def _zrow(nb: int, bits: int) -> int:
    return (nb + 1) // 2 if bits == 4 else nb


def _default_zp(e: int, rows: int, nb: int, bits: int) -> np.ndarray:
    """The zero-points a weight without them implies (2^(bits-1) every block), in the packed zp layout."""
    fill = 0x88 if bits == 4 else 0x80
    z = np.full((e, rows, _zrow(nb, bits)), fill, np.uint8)
    if bits == 4 and nb % 2:
        z[..., -1] = 0x08  # the unused high nibble of an odd count: 0, as a packer writes it
    return z


def as_host_experts(p: Any) -> HostExperts:
    """One packed weight (anything with ``B``, ``scales``, ``zp``, ``perm``, ``K``, ``N``, ``bits``,
    ``block_size`` (or ``bs``), optionally ``experts``: ``quant.HostPacked``, the tests' ``Packed``) as stacked
    experts (an unstacked one: one expert). ValueError for act order or K % block_size != 0."""
    K, R, bits = int(p.K), int(p.N), int(p.bits)
    bs = int(p.block_size if hasattr(p, "block_size") else p.bs)
    if getattr(p, "perm", None) is not None:
        raise ValueError("packed experts with act order (g_idx / desc_act) are not supported by moe_nbits_decode "
                         "yet: keep them dequantised")
    if bits not in BITS or bs < 16 or bs % 16 or K % bs:
        raise ValueError(f"packed experts [{R}, {K}] {bits}-bit, block {bs}: bits 4 / 8, a block size that is a "
                         "multiple of 16 dividing K")
    E = max(1, int(getattr(p, "experts", 0)))
    nb = K // bs
    B = np.ascontiguousarray(p.B, np.uint8).reshape(E, R, K * bits // 8)
    scales = np.ascontiguousarray(p.scales, np.float32).reshape(E, R, nb)
    zp = None if p.zp is None else np.ascontiguousarray(p.zp, np.uint8).reshape(E, R, _zrow(nb, bits))
    return HostExperts(B, scales, zp, R, K, bits, bs)


def stack_experts(parts: Sequence[HostExperts]) -> HostExperts:
    """Experts of several stacked weights one after the other on axis 0 (the routed experts, then the shared
    expert folded as expert E). They must agree in rows, K, bits and block size; where only some carry zero-points
    the others get their implied ones (2^(bits-1))."""
    if not parts:
        raise ValueError("nothing to stack")
    a = parts[0]
    if bad := [i for i, p in enumerate(parts) if (p.rows, p.K, p.bits, p.block_size) != (a.rows, a.K, a.bits,
                                                                                          a.block_size)]:
        raise ValueError(f"experts {bad} differ from the first in rows / K / bits / block size "
                         f"({[(parts[i].rows, parts[i].K, parts[i].bits, parts[i].block_size) for i in bad]} vs "
                         f"{(a.rows, a.K, a.bits, a.block_size)}): one launch runs one layout")
    nb = a.K // a.block_size
    zp = None
    if any(p.zp is not None for p in parts):
        zp = np.concatenate([p.zp if p.zp is not None else _default_zp(p.experts, p.rows, nb, p.bits)
                             for p in parts])
    return HostExperts(np.concatenate([p.B for p in parts]), np.concatenate([p.scales for p in parts]), zp,
                       a.rows, a.K, a.bits, a.block_size)


def fuse_rows(parts: Sequence[HostExperts]) -> HostExperts:
    """Row blocks of each expert one after the other (gate rows then up rows: w_gu [E][2I][H]); the same rules as
    :func:`stack_experts`, but the row counts may differ."""
    if not parts:
        raise ValueError("nothing to fuse")
    a = parts[0]
    if bad := [i for i, p in enumerate(parts) if (p.experts, p.K, p.bits, p.block_size) != (a.experts, a.K, a.bits,
                                                                                            a.block_size)]:
        raise ValueError(f"parts {bad} differ from the first in experts / K / bits / block size")
    nb = a.K // a.block_size
    zp = None
    if any(p.zp is not None for p in parts):
        zp = np.concatenate([p.zp if p.zp is not None else _default_zp(p.experts, p.rows, nb, p.bits)
                             for p in parts], axis=1)
    return HostExperts(np.concatenate([p.B for p in parts], axis=1), np.concatenate([p.scales for p in parts], axis=1),
                       zp, sum(p.rows for p in parts), a.K, a.bits, a.block_size)
