"""The MoE of prefill steps on tensor cores (``ops/cuda/moe_gemm.cu``): device routing for many tokens, a
tile list built on the device, and two grouped GEMMs — no host synchronisation, no per-expert Python loop.

Per call, five guarded launches on the device's stream, all programmatic dependents (``pdl=True``):

1. ``moe_topk`` grid ``(ncta,)`` x 1024: per token (one warp) softmax + top-k, bit for bit ``moe_route``'s
   (ties to the lower expert id, renormalised when ``norm_topk_prob``); per-CTA expert counts.
2. ``moe_group`` grid ``(ncta,)`` x 1024: counts -> exclusive scan -> ``expert_off``, ``active``, the tile
   list (CTA 0) and ``pair_list`` grouped by expert (ascending pair index within an expert): exactly
   ``moe_route``'s output contract, so the rest of the backend reads the same buffers.
3. ``moe_gemm_gate_up`` grid ``(I / 64, max_tiles)`` x 128, 96 KB of shared memory: per tile of up to
   :data:`GEMM_BM` pairs of one expert, ``act[p] = silu(h_t Wg^T) * (h_t Wu^T)`` (T, ``[pairs, I]``).
4. ``moe_gemm_down`` grid ``(H / 128, max_tiles)`` x 128: ``y[t, slot] = pair_w[p] * act[p] Wd^T`` (float32
   ``[n, ny, H]``, one slot per pair: no atomics); ``moe_gemm_down_t`` (``y_dtype`` = the bundle dtype: the backend's
   prefill steps) writes the same products rounded once to bf16 / fp16, half the bytes for the GEMM to write and
   the next add + RMSNorm to read.

``ncta = ceil(n / chunk)`` routing CTAs of ``chunk`` tokens (:func:`route_geometry`); the GEMM grids use
the bound :func:`max_tiles` and their CTAs past the device's tile count exit at once. Each output row
depends on its own pair only and the k order is fixed, so a token's result has the same bits whatever else
shares the step (batch invariance of a prompt).

Two builds of the grouped GEMMs (``impl``): ``"mma"`` (``moe_gemm.cu``: mma.sync m16n8k16, 4 warps, 128 x 128
tiles, any sm_80+ GPU) and ``"wgmma"`` (``ops/cuda/moe_wgmma.cu``: Hopper warpgroup MMA, compiled for sm_90a and
loaded on compute capability 9.0 only; two warpgroups, 128 x 256 tiles, :data:`WGMMA_VARIANTS` also has a
128 x 128 build at two CTAs per SM, ``"wgmma128"``; ``"wgmma_ws"`` is ``ops/cuda/moe_wgmma_ws.cu``: the 128 x 256
tiles on a persistent grid of one CTA per SM, warp-specialised - a cp.async producer warpgroup and two wgmma
consumer warpgroups synchronised by mbarriers, the epilogue of one work item under the next item's copies).
``"wgmma64"`` is ``moe_wgmma.cu`` on tiles of up to 64 rows (one warpgroup, 64 x 256 tiles): ``moe_group`` then
cuts each expert's pairs into 64-row tiles (its ``bm`` argument), so a step with few pairs per expert computes half
as many padding rows on its experts' last tiles; it gives a row ``"wgmma"``'s and ``"wgmma_ws"``'s bits (the same
m64n256k16 instructions in the same k order). Measured, it is no faster where it saves rows (the step is bound by
reading every expert's weights) and slower from 2k tokens on (benchmarks/results/gpu_moe_prefill_h200.md), so
``"auto"`` does not take it. ``"auto"`` picks :data:`AUTO_IMPL` where it runs, else ``"mma"``; a shape the wgmma
tiles do not divide runs ``"mma"`` (:meth:`MoEPrefill.gemm_impl`). Routing is ``moe_gemm.cu``'s in every case, and
the mma kernels are the same build whatever ``impl`` is.

Packed experts (a GPTQ bundle's int4 / int8 stacks kept packed, ``packed_weights`` experts / all): the same routing
and tile list, then the ``"wgmma_ws"`` GEMMs built with ``-DWS_NBITS=4|8`` (:data:`PACKED_VARIANTS`,
:meth:`MoEPrefill.experts_packed`): the producer warpgroup copies the packed codes, scales and zero-points and
dequantises each weight tile into shared memory itself, so a step reads the packed bytes once and writes no
dequantised stack; the bits are those of dequantising the stack (``nbits_dequant8``) and running ``"wgmma_ws"`` on it.
Where they do not run (:meth:`MoEPrefill.packed_problems`: not on compute capability 9.0, act order, a block size
the chunks straddle, 64-row tiles) the backend dequantises the stack first, as before.

bfloat16 / float16 only: float32 bundles (parity tests) keep ``fused.cu``'s CUDA-core kernels, as do shapes
the tiles do not divide (:func:`supported`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from .driver import CudaDevice, DeviceArray
from .kernels import Module, load_module
from .quant import PackedLinear
from .weights import MoEWeights

log = logging.getLogger(__name__)

SOURCE = "moe_gemm.cu"
WGMMA_SOURCE = "moe_wgmma.cu"
WGMMA_ARCH = "sm_90a"  # wgmma needs the arch-specific target: cubins run on compute capability 9.0 only
# What "auto" runs on a compute capability 9.0 GPU: set to "mma" to make the mma.sync build the default again.
AUTO_IMPL = "wgmma_ws"
WGMMA_WS_SOURCE = "moe_wgmma_ws.cu"
IMPLS = ("auto", "mma", "wgmma", "wgmma128", "wgmma_ws", "wgmma64")
SMALL_BM = 64  # rows per tile of the 64-row build (moe_group's bm)


@dataclass(frozen=True)
class WgmmaVariant:
    """One build of ``moe_wgmma.cu`` (or, ``persistent``, of ``moe_wgmma_ws.cu``): ``bn`` weight rows per CTA
    (gate_up: bn / 2 act columns), ring depth, wgmma groups left in flight per k tile, dynamic shared memory (the
    stages + 1 KB of alignment); ``threads`` per CTA; ``lag``: stages a producer thread of the warp-specialised
    build keeps in flight before it signals the oldest one."""

    bn: int
    stages: int
    inflight: int
    source: str = WGMMA_SOURCE
    threads: int = 256
    persistent: bool = False
    lag: int = 0
    bm: int = 128  # rows per tile: 128, or 64 (moe_wgmma.cu -DWG_BM=64: one warpgroup, threads 128)
    nbits: int = 0  # 4 / 8: the packed-experts build of moe_wgmma_ws.cu (-DWS_NBITS; persistent only)

    @property
    def smem(self) -> int:
        """Dynamic shared memory: the stages, the packed build's staging ring (lag + 1 slots of 128 * nbits code
        chunks, 24 bytes each: 16 of codes, a scale, a zero-point) and 1 KB of alignment."""
        staging = (self.lag + 1) * 128 * self.nbits * 24 if self.nbits else 0
        return self.stages * (self.bm + self.bn) * 64 * 2 + staging + 1024

    @property
    def options(self) -> tuple[str, ...]:
        if self.persistent:
            return (f"-DWS_STAGES={self.stages}", f"-DWS_LAG={self.lag}",
                    *((f"-DWS_NBITS={self.nbits}",) if self.nbits else ()))
        return (f"-DWG_BN={self.bn}", f"-DWG_STAGES={self.stages}", f"-DWG_INFLIGHT={self.inflight}",
                *((f"-DWG_BM={self.bm}",) if self.bm != 128 else ()))

    def grid(self, nx: int, tiles: int, sm_count: int) -> tuple[int, int, int]:
        """Launch grid of one GEMM of ``nx`` column blocks over (at most) ``tiles`` tiles: ``(nx, tiles, 1)``, or
        for the persistent build ``(min(sm_count, nx * tiles), 1, 1)`` (its CTAs loop over the work items
        ``tile * nx + x`` below the device's tile count x nx)."""
        if self.persistent:
            return (max(1, min(sm_count, nx * tiles)), 1, 1)
        return (nx, tiles, 1)

    def takes(self, hidden: int, inter: int) -> bool:
        """Whether these tiles divide the shape: H % bn (down's columns), I % (bn / 2) (gate_up's), K % 64."""
        return hidden % self.bn == 0 and inter % (self.bn // 2) == 0 and hidden % 64 == 0 and inter % 64 == 0


WGMMA_VARIANTS = {"wgmma": WgmmaVariant(256, 4, 1), "wgmma128": WgmmaVariant(128, 3, 0),
                  "wgmma_ws": WgmmaVariant(256, 4, 1, WGMMA_WS_SOURCE, 384, True, 1),
                  "wgmma64": WgmmaVariant(256, 4, 1, threads=128, bm=SMALL_BM)}
# The packed-experts builds (moe_wgmma_ws.cu -DWS_NBITS): int4 keeps the 4-stage ring (216 KB of shared memory with its
# staging), int8's staging is twice as large, so 3 stages (193 KB); one stage of lag, two staging slots.
PACKED_VARIANTS = {4: WgmmaVariant(256, 4, 1, WGMMA_WS_SOURCE, 384, True, 1, nbits=4),
                   8: WgmmaVariant(256, 3, 1, WGMMA_WS_SOURCE, 384, True, 1, nbits=8)}
# The most tokens a step runs on each packed build (the backend dequantises the stack first past it): measured on the
# H200 (benchmarks/results/gpu_moe_prefill_packed_h200.md, one 35B-A3B layer), int4 packed beats dequantise-then-GEMM
# at 1k and 8k tokens (600 vs 1135 us, 1517 vs 1638), int8 at 1k (756 vs 1128) but not at 8k (1864 vs 1639).
PACKED_MAX_TOKENS = {4: 1 << 30, 8: 4096}
DT_CODES = {"float16": 1, "bfloat16": 2}
GEMM_BM = 128  # pairs (rows) per tile: moe_gemm.cu's GEMM_BM
GATE_UP_BN = 64  # act columns per gate_up CTA (64 gate + 64 up rows of the weights)
DOWN_BN = 128  # y columns per down CTA
GEMM_THREADS = 128
GEMM_SMEM = 3 * (GEMM_BM + 128) * 64 * 2  # GEMM_STAGES x (A + B tile) x BK x 2 bytes = 96 KB
TOPK_THREADS = 1024
GROUP_THREADS = 1024
ROUTE_MAX_CTAS = 128  # routing CTAs at most (cta_counts rows)
ROUTE_MIN_CHUNK = 8  # tokens per routing CTA at least
MAX_EXPERTS = 1024  # E_all: one moe_group thread per expert
MAX_TOPK = 31


def supported(dtype: str, hidden: int, inter: int, e_all: int, k: int) -> bool:
    """Whether the tensor-core path runs this shape: bf16/fp16, H % 128 == 0, I % 64 == 0 (whole tiles of
    the GEMMs' K and N), at most 1024 experts and top-31."""
    return (dtype in DT_CODES and hidden > 0 and inter > 0 and hidden % DOWN_BN == 0 and inter % GATE_UP_BN == 0
            and 0 < e_all <= MAX_EXPERTS and 0 < k <= MAX_TOPK)


def route_geometry(n: int) -> tuple[int, int]:
    """(ncta, chunk): routing CTAs and tokens per CTA for ``n`` tokens (ncta <= ROUTE_MAX_CTAS)."""
    if n < 1:
        raise ValueError(f"need at least one token, got {n}")
    chunk = max(ROUTE_MIN_CHUNK, -(-n // ROUTE_MAX_CTAS))
    return -(-n // chunk), chunk


def max_tiles(pairs: int, e_all: int, bm: int = GEMM_BM) -> int:
    """Upper bound of ``sum_e ceil(count_e / bm)`` over any routing of ``pairs`` pairs to ``e_all`` experts
    (each expert wastes less than one tile): the GEMM grids' y extent."""
    return -(-pairs // bm) + min(e_all, pairs)


def tile_list_words(max_pairs: int, e_all: int) -> int:
    """int32 words of the tile-list buffer for up to ``max_pairs`` pairs in tiles of any size a build runs (the
    smallest, :data:`SMALL_BM`, makes the most): a 4-word header (count) + 4 words per tile (expert, first
    pair_list slot, rows, unused)."""
    return 4 + 4 * max_tiles(max_pairs, e_all, SMALL_BM)


def tile_list(counts: np.ndarray, bm: int = GEMM_BM) -> np.ndarray:
    """The tile list ``moe_group`` writes, as numpy ``[tiles, 3]`` (expert, first slot, rows): the model the
    tests check the device against."""
    counts = np.asarray(counts, np.int64)
    off = np.concatenate([[0], np.cumsum(counts)])
    out = [(e, off[e] + j * bm, min(bm, c - j * bm)) for e, c in enumerate(counts) for j in range(-(-c // bm))]
    return np.array(out, np.int64).reshape(-1, 3)


def zero_points_i32(zp: np.ndarray, experts: int, rows: int, nb: int, bits: int) -> np.ndarray:
    """A packed stack's zero-points as the packed prefill GEMMs read them: int32 ``[experts, rows * nb]``, one per
    (row, block), from PackedLinear's ``zp`` (4-bit: ``[experts, rows * ceil(nb / 2)]`` two a byte, low nibble first;
    8-bit: ``[experts, rows * nb]``)."""
    if bits not in (4, 8):
        raise ValueError(f"zero-points of {bits}-bit codes")
    z = np.asarray(zp, np.uint8).reshape(experts, rows, -1)
    if bits == 4:
        z = np.stack([z & 15, z >> 4], axis=-1).reshape(experts, rows, -1)
    if z.shape[2] < nb:
        raise ValueError(f"zero-points of {z.shape[2]} blocks a row, the weight has {nb}")
    return np.ascontiguousarray(z[:, :, :nb].reshape(experts, rows * nb).astype(np.int32))


@dataclass(frozen=True)
class MoEBuffers:
    """Device pointers of the MoE's scratch (the backend's arena): ``pair_w`` float32 ``[n*kk]``, ``pair_e``
    and ``pair_list`` int32 ``[n*kk]``, ``expert_off`` / ``active`` int32 ``[E_all + 1]``, ``tiles`` int32
    ``[tile_list_words]``, ``cta_counts`` int32 ``[ROUTE_MAX_CTAS, E_all]``, ``act`` T ``[n*kk, I]``, ``y``
    ``[n, ny, H]`` float32 (or T: ``experts(y_dtype=...)``); ``tile_capacity`` = tiles the ``tiles`` buffer holds."""

    pair_w: int
    pair_e: int
    pair_list: int
    expert_off: int
    active: int
    tiles: int
    cta_counts: int
    act: int
    y: int
    tile_capacity: int


class MoEPrefill:
    """The tensor-core MoE kernels for one bundle dtype on one device (see the module docstring)."""

    def __init__(self, device: CudaDevice, dtype: str, impl: str = "auto") -> None:
        """``impl``: ``"auto"`` (:data:`AUTO_IMPL` on compute capability 9.0 if its module compiled and
        loaded, else ``"mma"``), ``"mma"``, ``"wgmma"``, ``"wgmma128"``, ``"wgmma_ws"`` or ``"wgmma64"`` (ValueError
        off compute capability 9.0; a compile error propagates). :attr:`impl` is the resolved choice."""
        if dtype not in DT_CODES:
            raise ValueError(f"the tensor-core MoE runs bfloat16 / float16, not {dtype!r}")
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, not {impl!r}")
        self.device, self.dtype = device, dtype
        self.module = load_module(SOURCE, (f"-DDT={DT_CODES[dtype]}",), device.arch)
        for name in ("moe_gemm_gate_up", "moe_gemm_down", "moe_gemm_down_t"):  # 96 KB: past the default 48 KB
            self.module.kernel(name).set_max_dynamic_smem(device, GEMM_SMEM)
        self.wgmma_module: Module | None = None
        self.variant: WgmmaVariant | None = None
        want = AUTO_IMPL if impl == "auto" else impl
        if want != "mma":
            on_hopper = tuple(device.compute_capability) == (9, 0)
            if impl != "auto" and not on_hopper:
                raise ValueError(f"impl {impl!r} needs compute capability 9.0, not {device.compute_capability}")
            if on_hopper:
                try:
                    self._load_wgmma(WGMMA_VARIANTS[want])
                except Exception:
                    if impl != "auto":
                        raise
                    log.exception("the wgmma MoE GEMMs did not build; the mma.sync ones run")
                    self.wgmma_module, self.variant = None, None
        self.impl = "mma" if self.variant is None else want

    def _load_wgmma(self, v: WgmmaVariant) -> None:
        self.wgmma_module = load_module(v.source, (f"-DDT={DT_CODES[self.dtype]}", *v.options), WGMMA_ARCH)
        for name in ("moe_wgmma_gate_up", "moe_wgmma_down", "moe_wgmma_down_t"):
            self.wgmma_module.kernel(name).set_max_dynamic_smem(self.device, v.smem)
        self.variant = v

    @property
    def tile_rows(self) -> int:
        """Rows per tile of the tile list :meth:`route` cuts: the build's (:data:`SMALL_BM` for ``"wgmma64"``),
        else :data:`GEMM_BM` (every build takes tiles of up to 128 rows)."""
        return self.variant.bm if self.variant is not None else GEMM_BM

    def gemm_impl(self, hidden: int, inter: int) -> str:
        """The build :meth:`experts` runs for this shape: :attr:`impl`, or ``"mma"`` where the wgmma tiles do not
        divide it."""
        return self.impl if self.variant is not None and self.variant.takes(hidden, inter) else "mma"

    def packed_problems(self, gate_up: PackedLinear, down: PackedLinear, hidden: int, inter: int, e_all: int,
                        zeros: tuple[DeviceArray | None, DeviceArray | None] = (None, None)) -> list[str]:
        """Why :meth:`experts_packed` cannot run these stacks (empty: it can): ``gate_up`` ``[E_all, 2I, H]`` and
        ``down`` ``[E_all, H, I]`` packed (quant.py PackedLinear, ``experts`` = E_all), ``zeros`` their int32
        zero-points (:func:`zero_points_i32`) where they have zero-points."""
        out = []
        if tuple(self.device.compute_capability) != (9, 0):
            out.append(f"the packed prefill GEMMs are Hopper (9.0) kernels, not {self.device.compute_capability}")
        if self.tile_rows != GEMM_BM:
            out.append(f"tiles of {self.tile_rows} rows (the packed GEMMs take {GEMM_BM})")
        for name, p, z, (n, k) in (("gate_up", gate_up, zeros[0], (2 * inter, hidden)),
                                   ("down", down, zeros[1], (hidden, inter))):
            v = PACKED_VARIANTS.get(p.bits)
            if v is None:
                out.append(f"{name}: {p.bits}-bit codes (4 or 8)")
                continue
            if not v.takes(hidden, inter):
                out.append(f"H={hidden}, I={inter}: not whole tiles of the packed GEMMs")
            if (p.N, p.K, p.k_in) != (n, k, k) or p.experts < e_all:
                out.append(f"{name}: {p.experts} x [{p.N}, {p.K}] (k_in {p.k_in}) is not a [{e_all}, {n}, {k}] stack")
            if p.perm is not None:
                out.append(f"{name}: act order (g_idx)")
            kpc = 128 // p.bits  # k per 16-byte code chunk
            if p.K % p.block_size or p.block_size % kpc:
                out.append(f"{name}: block size {p.block_size} (K % block size == 0, block size % {kpc} == 0)")
            if p.zp is not None and z is None:
                out.append(f"{name}: zero-points without their int32 copy (zero_points_i32)")
        return out

    def packed_module(self, bits: int) -> Module:
        """The packed grouped GEMMs' build for ``bits`` (4 / 8), compiled (NVRTC) and loaded on first use (the
        backend asks at load, so that no step or graph capture compiles)."""
        mods = self.__dict__.setdefault("_packed_modules", {})
        if bits not in mods:
            v = PACKED_VARIANTS[bits]
            mod = load_module(v.source, (f"-DDT={DT_CODES[self.dtype]}", *v.options), WGMMA_ARCH)
            for name in ("moe_wgmma_nb_gate_up", "moe_wgmma_nb_down", "moe_wgmma_nb_down_t"):
                mod.kernel(name).set_max_dynamic_smem(self.device, v.smem)
            mods[bits] = mod
        return mods[bits]

    def _check_gemm_args(self, hidden: int, inter: int, ldh: int, kk: int, ny: int, y_dtype: str, gemms: str) -> None:
        """ValueError for arguments :meth:`experts` and :meth:`experts_packed` do not take."""
        if hidden % DOWN_BN or inter % GATE_UP_BN or ldh % 8 or ldh < hidden or ny < kk:
            raise ValueError(f"H={hidden}, I={inter}, ldh={ldh}, ny={ny}: not a shape of the tensor-core MoE")
        if y_dtype not in ("float32", self.dtype):
            raise ValueError(f"y_dtype {y_dtype!r}: float32 or the bundle dtype {self.dtype!r}")
        if gemms not in ("both", "gate_up", "down"):
            raise ValueError(f"gemms must be 'both', 'gate_up' or 'down', not {gemms!r}")

    def experts_packed(self, n: int, h: int, ldh: int, gate_up: PackedLinear, down: PackedLinear, hidden: int,
                       inter: int, kk: int, ny: int, e_all: int, bufs: MoEBuffers, y_dtype: str = "float32",
                       zeros: tuple[DeviceArray | None, DeviceArray | None] = (None, None),
                       gemms: str = "both") -> None:
        """:meth:`experts` on packed stacks (``gate_up`` / ``down``: PackedLinear ``[E_all, 2I, H]`` / ``[E_all, H,
        I]``; ``zeros``: their int32 zero-points, :func:`zero_points_i32`): the same outputs, bit for bit, as
        dequantising them (quant.py NBitsDequant) and calling :meth:`experts` with ``"wgmma_ws"``. ValueError with
        :meth:`packed_problems`' reasons where it cannot run."""
        self._check_gemm_args(hidden, inter, ldh, kk, ny, y_dtype, gemms)
        if bad := self.packed_problems(gate_up, down, hidden, inter, e_all, zeros):
            raise ValueError("packed prefill MoE: " + "; ".join(bad))
        tiles = max_tiles(n * kk, e_all, self.tile_rows)
        sms = self.device.limits.sm_count
        zp = [z.ptr if z is not None else 0 for z in zeros]
        if gemms in ("both", "gate_up"):
            v = PACKED_VARIANTS[gate_up.bits]
            self.packed_module(gate_up.bits).kernel("moe_wgmma_nb_gate_up").launch(
                self.device, v.grid(inter // (v.bn // 2), tiles, sms), (v.threads, 1, 1), v.smem,
                [("ptr", h), ("i64", ldh), ("ptr", gate_up.B.ptr), ("ptr", gate_up.scales.ptr), ("ptr", zp[0]),
                 ("i32", gate_up.block_size), ("i32", hidden), ("i32", inter), ("i32", kk), ("ptr", bufs.tiles),
                 ("ptr", bufs.pair_list), ("ptr", bufs.act)], pdl=True)
        if gemms in ("both", "down"):
            v = PACKED_VARIANTS[down.bits]
            name = "moe_wgmma_nb_down" if y_dtype == "float32" else "moe_wgmma_nb_down_t"
            self.packed_module(down.bits).kernel(name).launch(
                self.device, v.grid(hidden // v.bn, tiles, sms), (v.threads, 1, 1), v.smem,
                [("ptr", bufs.act), ("ptr", down.B.ptr), ("ptr", down.scales.ptr), ("ptr", zp[1]),
                 ("i32", down.block_size), ("ptr", bufs.pair_w), ("i32", hidden), ("i32", inter), ("i32", kk),
                 ("i32", ny), ("ptr", bufs.tiles), ("ptr", bufs.pair_list), ("ptr", bufs.y)], pdl=True)

    def _launch(self, name: str, grid: tuple[int, int, int], block: int, args: list, smem: int = 0) -> None:
        self.module.kernel(name).launch(self.device, grid, (block, 1, 1), smem, args, pdl=True)

    def route(self, n: int, logits: int, ld: int, num_experts: int, k: int, renorm: bool, bufs: MoEBuffers,
              fold_shared: bool = False) -> None:
        """Routing + grouping + tile list for ``n`` tokens from ``logits`` (float32 ``[n, ld]``; with
        ``fold_shared`` the shared expert is expert E, slot k, weight sigmoid(logits[:, E]))."""
        e_all, kk = num_experts + int(fold_shared), k + int(fold_shared)
        if not (0 < e_all <= MAX_EXPERTS and 0 < k <= MAX_TOPK and k <= num_experts):
            raise ValueError(f"routing of top-{k} over {num_experts} experts is not supported")
        bm = self.tile_rows
        need = max_tiles(n * kk, e_all, bm)
        if need > bufs.tile_capacity:
            raise ValueError(f"{n} tokens need room for {need} tiles, the tile list holds {bufs.tile_capacity}")
        ncta, chunk = route_geometry(n)
        self._launch("moe_topk", (ncta, 1, 1), TOPK_THREADS,
                     [("ptr", logits), ("i32", ld), ("i32", n), ("i32", num_experts), ("i32", k),
                      ("i32", int(renorm)), ("i32", int(fold_shared)), ("i32", chunk), ("ptr", bufs.pair_w),
                      ("ptr", bufs.pair_e), ("ptr", bufs.cta_counts)])
        self._launch("moe_group", (ncta, 1, 1), GROUP_THREADS,
                     [("ptr", bufs.pair_e), ("i32", n), ("i32", kk), ("i32", e_all), ("i32", chunk), ("i32", ncta),
                      ("ptr", bufs.cta_counts), ("ptr", bufs.expert_off), ("ptr", bufs.pair_list),
                      ("ptr", bufs.active), ("ptr", bufs.tiles), ("i32", need), ("i32", bm)])

    def experts(self, n: int, h: int, ldh: int, gate_up: int, down: int, hidden: int, inter: int, kk: int, ny: int,
                e_all: int, bufs: MoEBuffers, y_dtype: str = "float32", gemms: str = "both") -> None:
        """The grouped GEMMs after :meth:`route`: h (T ``[n, ldh]``), stacked weights ``gate_up``
        ``[E_all, 2I, H]`` and ``down`` ``[E_all, H, I]`` (device pointers) -> ``bufs.act``, ``bufs.y``.
        ``y_dtype``: ``"float32"``, or the bundle dtype (the ``_t`` down kernels: the same float32 products, each
        rounded once to T, round to nearest even). ``gemms``: ``"both"``, or only ``"gate_up"`` / ``"down"``
        (benchmarks time them apart; down reads the act a gate_up launch left)."""
        self._check_gemm_args(hidden, inter, ldh, kk, ny, y_dtype, gemms)
        run_gu, run_d = gemms in ("both", "gate_up"), gemms in ("both", "down")
        down_name = "down" if y_dtype == "float32" else "down_t"
        tiles = max_tiles(n * kk, e_all, self.tile_rows)  # the tiles route() cut
        v = self.variant
        if v is not None and self.wgmma_module is not None and v.takes(hidden, inter):
            k_gu = self.wgmma_module.kernel("moe_wgmma_gate_up")
            k_d = self.wgmma_module.kernel(f"moe_wgmma_{down_name}")
            sms = self.device.limits.sm_count
            if run_gu:
                k_gu.launch(self.device, v.grid(inter // (v.bn // 2), tiles, sms), (v.threads, 1, 1), v.smem,
                            [("ptr", h), ("i64", ldh), ("ptr", gate_up), ("i32", hidden), ("i32", inter),
                             ("i32", kk), ("ptr", bufs.tiles), ("ptr", bufs.pair_list), ("ptr", bufs.act)], pdl=True)
            if run_d:
                k_d.launch(self.device, v.grid(hidden // v.bn, tiles, sms), (v.threads, 1, 1), v.smem,
                           [("ptr", bufs.act), ("ptr", down), ("ptr", bufs.pair_w), ("i32", hidden),
                            ("i32", inter), ("i32", kk), ("i32", ny), ("ptr", bufs.tiles), ("ptr", bufs.pair_list),
                            ("ptr", bufs.y)], pdl=True)
            return
        if run_gu:
            self._launch("moe_gemm_gate_up", (inter // GATE_UP_BN, tiles, 1), GEMM_THREADS,
                         [("ptr", h), ("i64", ldh), ("ptr", gate_up), ("i32", hidden), ("i32", inter), ("i32", kk),
                          ("ptr", bufs.tiles), ("ptr", bufs.pair_list), ("ptr", bufs.act)], smem=GEMM_SMEM)
        if run_d:
            self._launch(f"moe_gemm_{down_name}", (hidden // DOWN_BN, tiles, 1), GEMM_THREADS,
                         [("ptr", bufs.act), ("ptr", down), ("ptr", bufs.pair_w), ("i32", hidden), ("i32", inter),
                          ("i32", kk), ("i32", ny), ("ptr", bufs.tiles), ("ptr", bufs.pair_list), ("ptr", bufs.y)],
                         smem=GEMM_SMEM)

    def launch(self, n: int, logits: int, ld: int, mw: MoEWeights, h: int, ldh: int, k: int, renorm: bool, ny: int,
               bufs: MoEBuffers, fold_shared: bool = False, y_dtype: str = "float32") -> None:
        """The routed experts of a step: :meth:`route` then :meth:`experts` on ``mw``'s stacks. Without
        ``fold_shared`` (prefill: the shared expert runs as GEMMs) ``y`` slots ``k .. ny-1`` are left untouched;
        with it (``mw.fold``: the shared expert is row E of the stacks) the shared expert is pair ``k`` of every
        token, its output in slot ``k`` weighted by sigmoid(logits[:, E]). ``y_dtype``: see :meth:`experts`."""
        if fold_shared and not mw.fold:
            raise ValueError("fold_shared needs the shared expert stacked as expert E (MoEWeights.fold)")
        H, two_i = mw.gate_up.shape[2], mw.gate_up.shape[1]
        kk, e_all = k + int(fold_shared), mw.num_experts + int(fold_shared)
        self.route(n, logits, ld, mw.num_experts, k, renorm, bufs, fold_shared=fold_shared)
        self.experts(n, h, ldh, mw.gate_up.ptr, mw.down.ptr, H, two_i // 2, kk, ny, e_all, bufs, y_dtype=y_dtype)
