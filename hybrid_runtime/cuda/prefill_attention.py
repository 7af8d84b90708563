"""GPU causal prefill attention over the paged KV cache (``ops/cuda/prefill_attention.cu``).

One launch covers a varlen batch of prefill chunks. Shapes (T = float16 or bfloat16, q and pools alike):

* q ``[n_tokens, Hq, hd]`` T, packed: sequence ``s`` owns rows ``[cu[s], cu[s+1])`` (``cu`` = prefix sums of
  ``q_lens``); its token ``i`` is at absolute position ``start_pos[s] + i``.
* k / v pools ``[num_pages, page_size, Hkv, hd]`` T. Every key ``0 .. start_pos[s] + q_lens[s] - 1`` must be in
  the pools already (the chunk's own tokens are written first), so chunked prefill (a chunk starting mid-page
  after cached pages) and prefix reuse need nothing else.
* page tables: int32, table ``s`` starts ``table_stride`` ints after table ``s - 1``; it must cover
  ``ceil((start_pos[s] + q_lens[s]) / page_size)`` pages.
* out ``[n_tokens, Hq, hd]`` float32, dense. Causal: the query at position ``p`` attends keys ``0..p``;
  scale ``1/sqrt(hd)``; GQA: query head ``h`` reads kv head ``h // (Hq / Hkv)``.

float32 is NOT supported (tensor cores only): the backend keeps its previous path for float32 bundles, and
:func:`plan_prefill` raises :class:`PrefillAttentionError` for it.

The host builds a work list (:func:`plan_prefill`): one int32 row ``(sequence, first packed q row, tokens,
first position)`` per CTA tile of ``tokens_per_tile = rows // G`` query tokens (the GQA group is packed into
the tile's rows), heaviest tiles (most keys) first; grid ``(n_work, Hkv, 1)``. :func:`pack_prefill_inputs`
puts the work list and the page tables into one int32 array for one upload.

Two implementations (:class:`PrefillVariant` ``impl``). ``"mma"`` (``prefill_attention.cu``, mma.sync, any
sm_80+ GPU, head dims 16..256) has two schedules (``warps``): 4 warps, 64-row tiles, single-buffered K/V (two
CTAs per SM at hd 256), and 8 warps, 128-row tiles, double-buffered K/V (one CTA per SM, 192 KB at hd 256), the
default for hd > 128: each K/V tile copied serves twice the rows, halving the L2 -> SM traffic per FLOP. A
row's arithmetic is the same in both (the same key tiles in the same order), so they give the same bits.
``"wgmma"`` (``prefill_attention_wgmma.cu``, Hopper warpgroup MMA, compute capability 9.0 only, head dims 64,
128 and 256) runs the 8-warp schedule's tiles (128 rows, two warpgroups, double-buffered K/V) with both
products on wgmma; ``"wgmma_ws"`` (the same file with ``-DWS``) is its warp-specialised form: a producer
warpgroup fills mbarrier-synchronised K and V rings and the two consumer warpgroups take turns issuing their
MMAs. Every plan of a build gives a row the same bits; on the H200 the wgmma builds also gave the mma.sync
build's bits in every case measured (GPU-tested; not a documented property of the hardware). ``"auto"``
(:class:`CudaPrefillAttention`'s default) takes :data:`AUTO_IMPL` (``"wgmma_ws"``) where it runs, else
``"mma"``: one build per process and shape, so batch invariance holds.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..ops.dispatcher import DeviceLimits
from .driver import CudaDevice, DeviceArray
from .kernels import Kernel, Launch, load_module

log = logging.getLogger(__name__)

SOURCE = "prefill_attention.cu"
ENTRY = "prefill_attn"
DT_CODES = {"float16": 1, "bfloat16": 2}
WARPS = 4  # the kernel's NWARPS of the 64-row build (single-buffered K/V)
THREADS = 32 * WARPS
WIDE_WARPS = 8  # the 128-row build (double-buffered K/V)
KEY_TILE = 64  # the kernel's BN
WORK_INTS = 4  # ints per work item: (sequence, first q row, tokens, first position)
ALIGN_INTS = 32  # the page tables start on a 128-byte line in pack_prefill_inputs' layout
MAX_HEAD_DIM = 256
IMPLS = ("auto", "mma", "wgmma", "wgmma_ws")
WGMMA_IMPLS = ("wgmma", "wgmma_ws")
AUTO_IMPL = "wgmma_ws"  # what "auto" runs on compute capability 9.0 (benchmarks/results/prefill_attention_h200.md)
WGMMA_SOURCE = "prefill_attention_wgmma.cu"
WGMMA_ENTRY = "prefill_attn_wgmma"
WGMMA_WS_ENTRY = "prefill_attn_wgmma_ws"  # the same source with -DWS
PRODUCER_THREADS = 128  # the warp-specialised build's copy warpgroup
WGMMA_ARCH = "sm_90a"  # wgmma needs the arch-specific target: its cubins run on compute capability 9.0 only
WGMMA_HEAD_DIMS = (64, 128, 256)  # whole 64-column (128-byte) swizzle slabs
WGMMA_ROWS = 128  # two warpgroups of 64 rows


class PrefillAttentionError(ValueError):
    """A prefill-attention shape this kernel cannot run; the message says what to change."""


def default_m_tiles(head_dim: int) -> int:
    """16-row m-tiles per warp: 2 (32 rows per warp, K/V fragments reused twice) where the registers allow it
    without spilling, else 1. NVRTC 13 on sm_90: hd <= 64 x 2 fits; hd 128 x 2 spills for some group sizes
    (G = 1), hd 256 x 2 cannot fit at all."""
    return 2 if head_dim <= 64 else 1


def default_warps(head_dim: int) -> int:
    """Warps per CTA: 8 (128-row tiles, double-buffered K/V, one CTA per SM) for hd > 128, where the 4-warp
    64-row build's K/V traffic per FLOP is the limit (hd 256: 249 registers, no spills); else 4 (unchanged:
    not measured against the 8-warp build there)."""
    return WIDE_WARPS if head_dim > 128 else WARPS


@dataclass(frozen=True)
class PrefillVariant:
    """One compiled build. ``impl`` ``"mma"``: ``prefill_attention.cu`` with ``-DHD -DDT -DG -DMT -DNWARPS
    -DSTAGES``; ``warps`` 4: K/V single-buffered (1 stage), 8: double-buffered (2 stages). ``"wgmma"``:
    ``prefill_attention_wgmma.cu`` with ``-DHD -DDT -DG`` (8 warps = two warpgroups, 128 rows, 2 stages;
    ``pv_split``: O += P V as hd / 64 wgmmas of n64 instead of one of n hd, ``-DPV_SPLIT``). ``"wgmma_ws"``: the
    same file with ``-DWS``, warp-specialised: the two warpgroups plus a producer warpgroup (384 threads) that
    issues every copy into mbarrier-synchronised K and V rings."""

    dtype: str
    head_dim: int
    group: int
    m_tiles: int = 1
    warps: int = WARPS
    impl: str = "mma"
    pv_split: bool = False

    @property
    def source(self) -> str:
        return WGMMA_SOURCE if self.impl in WGMMA_IMPLS else SOURCE

    @property
    def entry(self) -> str:
        return {"wgmma": WGMMA_ENTRY, "wgmma_ws": WGMMA_WS_ENTRY}.get(self.impl, ENTRY)

    @property
    def stages(self) -> int:
        """K/V tile buffers (the kernel's STAGES)."""
        return 2 if self.warps == WIDE_WARPS else 1

    @property
    def threads(self) -> int:
        return 32 * self.warps + (PRODUCER_THREADS if self.impl == "wgmma_ws" else 0)

    @property
    def rows(self) -> int:
        """Query rows (token x head) per CTA tile (the kernel's BM)."""
        return self.warps * 16 * self.m_tiles

    @property
    def tokens_per_tile(self) -> int:
        return self.rows // self.group

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: Q tile [rows][hd] + ``stages`` x (one K and one V tile [64][hd]), all T (+ 1 KB
        for the wgmma build to align its operands to the 1024-byte swizzle atom)."""
        return (self.rows + 2 * KEY_TILE * self.stages) * self.head_dim * 2 + (1024 if self.impl in WGMMA_IMPLS else 0)

    @property
    def arch(self) -> str | None:
        """The compile target the build needs (None: the device's own)."""
        return WGMMA_ARCH if self.impl in WGMMA_IMPLS else None

    @property
    def options(self) -> tuple[str, ...]:
        if self.impl in WGMMA_IMPLS:
            return (f"-DHD={self.head_dim}", f"-DDT={DT_CODES[self.dtype]}", f"-DG={self.group}",
                    *(("-DPV_SPLIT",) if self.pv_split else ()), *(("-DWS",) if self.impl == "wgmma_ws" else ()))
        return (f"-DHD={self.head_dim}", f"-DDT={DT_CODES[self.dtype]}", f"-DG={self.group}",
                f"-DMT={self.m_tiles}", f"-DNWARPS={self.warps}", f"-DSTAGES={self.stages}")


def wgmma_takes(dtype: str, head_dim: int, group: int) -> bool:
    """Whether the wgmma build exists for this shape (the device must also be compute capability 9.0)."""
    return dtype in DT_CODES and head_dim in WGMMA_HEAD_DIMS and 1 <= group <= WGMMA_ROWS


def choose_prefill_variant(dtype: str, head_dim: int, group: int, m_tiles: int | None = None,
                           warps: int | None = None, impl: str = "mma", pv_split: bool = False) -> PrefillVariant:
    """The build for ``(dtype, head_dim, group = Hq / Hkv)`` (``m_tiles`` / ``warps``: override the defaults,
    :func:`default_m_tiles` / :func:`default_warps`, ``"mma"`` only; ``impl``: ``"mma"``, ``"wgmma"`` or
    ``"wgmma_ws"``, already resolved: :class:`CudaPrefillAttention` resolves ``"auto"`` on its device);
    :class:`PrefillAttentionError` if none can run."""
    if dtype not in DT_CODES:
        raise PrefillAttentionError(
            f"prefill attention runs float16 / bfloat16 only (tensor cores), got {dtype}: keep the per-token "
            "decode path for float32 bundles or build the bundle in bfloat16")
    if head_dim % 16 or not 16 <= head_dim <= MAX_HEAD_DIM:
        raise PrefillAttentionError(
            f"head_dim {head_dim} unsupported: it must be a multiple of 16 in 16..{MAX_HEAD_DIM}")
    if impl in WGMMA_IMPLS:
        if m_tiles not in (None, 1) or warps not in (None, WIDE_WARPS):
            raise PrefillAttentionError(f"the wgmma build has one schedule ({WIDE_WARPS} warps, 1 m-tile), got "
                                        f"m_tiles={m_tiles}, warps={warps}")
        if not wgmma_takes(dtype, head_dim, group):
            raise PrefillAttentionError(f"the wgmma build runs head_dim in {WGMMA_HEAD_DIMS} and GQA groups "
                                        f"1..{WGMMA_ROWS}, got head_dim {head_dim}, group {group}: use impl 'mma'")
        return PrefillVariant(dtype, head_dim, int(group), 1, WIDE_WARPS, impl, bool(pv_split))
    if impl != "mma":
        raise PrefillAttentionError(f"impl must be 'mma', 'wgmma' or 'wgmma_ws' here, got {impl!r}")
    mt = default_m_tiles(head_dim) if m_tiles is None else int(m_tiles)
    if mt not in (1, 2):
        raise PrefillAttentionError(f"m_tiles must be 1 or 2, got {mt}")
    nw = default_warps(head_dim) if warps is None else int(warps)
    if nw not in (WARPS, WIDE_WARPS):
        raise PrefillAttentionError(f"warps must be {WARPS} or {WIDE_WARPS}, got {nw}")
    v = PrefillVariant(dtype, head_dim, int(group), mt, nw)
    if not 1 <= group <= v.rows:
        raise PrefillAttentionError(
            f"GQA group Hq/Hkv = {group} unsupported: it must be in 1..{v.rows} (query rows per tile)")
    return v


@dataclass(frozen=True, eq=False)
class PrefillPlan:
    """A validated launch of one varlen prefill batch.

    ``work``: int32 ``[n_work, 4]`` (read-only), rows ``(sequence, first packed q row, tokens, first absolute
    position)``, heaviest tile first. ``cu_seqlens``: int64 ``[B + 1]``. Launch: ``grid`` x ``block`` threads
    with ``smem_bytes`` of dynamic shared memory. ``n_work == 0`` (every ``q_len`` is 0): nothing to launch.
    """

    variant: PrefillVariant
    work: np.ndarray
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int
    q_lens: tuple[int, ...]
    start_pos: tuple[int, ...]
    cu_seqlens: np.ndarray
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str

    @property
    def n_work(self) -> int:
        return int(self.work.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def scale_log2(self) -> float:
        return math.log2(math.e) / math.sqrt(self.head_dim)

    def pages_needed(self, s: int) -> int:
        """Pages table ``s`` must cover: keys ``0 .. start_pos[s] + q_lens[s] - 1``."""
        return -(-(self.start_pos[s] + self.q_lens[s]) // self.page_size)

    def causal_flops(self) -> int:
        """2 matmuls x 2 flops x Hq x hd x (sum over queries of the keys each attends)."""
        keys = sum(n * (p + 1) + n * (n - 1) // 2 for n, p in zip(self.q_lens, self.start_pos))
        return 4 * self.num_q_heads * self.head_dim * keys


def plan_prefill(q_lens: Sequence[int], start_pos: Sequence[int], *, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, dtype: str, page_size: int, limits: DeviceLimits,
                 m_tiles: int | None = None, warps: int | None = None, impl: str = "mma",
                 pv_split: bool = False) -> PrefillPlan:
    """Pure host: the work list and launch geometry of one prefill batch (``q_lens[s]`` new tokens of sequence
    ``s`` at positions ``start_pos[s] ..``), validated against ``limits``. Raises :class:`PrefillAttentionError`
    naming what to change when the shape cannot run."""
    if len(q_lens) != len(start_pos):
        raise PrefillAttentionError(f"{len(q_lens)} q_lens but {len(start_pos)} start positions")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise PrefillAttentionError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if page_size < 16 or page_size % 16:
        raise PrefillAttentionError(f"page_size {page_size} unsupported: it must be a multiple of 16 (>= 16)")
    v = choose_prefill_variant(dtype, head_dim, num_q_heads // num_kv_heads, m_tiles, warps, impl, pv_split)
    lens = [int(n) for n in q_lens]
    pos = [int(p) for p in start_pos]
    if any(n < 0 for n in lens) or any(p < 0 for p in pos):
        raise PrefillAttentionError("q_lens and start_pos must be >= 0")
    if any(p + n >= 2**31 for n, p in zip(lens, pos)):
        raise PrefillAttentionError("positions must fit int32")
    cu = np.zeros(len(lens) + 1, np.int64)
    cu[1:] = np.cumsum(lens, dtype=np.int64)
    if cu[-1] >= 2**31:
        raise PrefillAttentionError(f"{cu[-1]} tokens: the work list indexes q rows with int32")
    tpt = v.tokens_per_tile
    rows = []
    for s, (n, p) in enumerate(zip(lens, pos)):
        t0 = np.arange(0, n, tpt, dtype=np.int64)
        if t0.size:
            rows.append(np.stack([np.full_like(t0, s), cu[s] + t0, np.minimum(tpt, n - t0), p + t0], axis=1))
    work = np.concatenate(rows) if rows else np.zeros((0, WORK_INTS), np.int64)
    # Heaviest first (keys = first position + tokens): the long tiles start in the first wave, short ones fill in.
    order = np.argsort(-(work[:, 3] + work[:, 2]), kind="stable")
    work = np.ascontiguousarray(work[order].astype(np.int32))
    work.setflags(write=False)
    problems = []
    if limits.max_threads_per_block < v.threads:
        problems.append(f"{v.threads} threads per block > the device's {limits.max_threads_per_block}")
    if v.smem_bytes > limits.max_shared_mem_optin:
        problems.append(f"{v.smem_bytes} bytes of shared memory > the device's opt-in limit "
                        f"{limits.max_shared_mem_optin} (use a smaller head_dim, m_tiles=1 or warps={WARPS})")
    if work.shape[0] > limits.max_grid_x:
        problems.append(f"{work.shape[0]} work items > max grid x {limits.max_grid_x}: split the batch")
    if num_kv_heads > limits.max_grid_y:
        problems.append(f"{num_kv_heads} kv heads > max grid y {limits.max_grid_y}")
    if problems:
        raise PrefillAttentionError(f"prefill attention cannot run on {limits.name}: " + "; ".join(problems))
    cu.setflags(write=False)
    return PrefillPlan(v, work, (max(1, work.shape[0]), num_kv_heads, 1), (v.threads, 1, 1), v.smem_bytes,
                       tuple(lens), tuple(pos), cu, num_q_heads, num_kv_heads, head_dim, page_size, dtype)


@dataclass(frozen=True, eq=False)
class PrefillInputs:
    """The kernel's int32 inputs in one host array (one upload): the work list at ``host[work_offset:]``
    (``plan.n_work * 4`` ints, offset 0), then table ``s`` at ``host[tables_offset + s * table_stride:]``
    (``tables_offset`` a multiple of 32 ints: a 128-byte line; rows zero-padded to the stride).
    On the device at address ``base``: ``work_ptr = base + 4 * work_offset``,
    ``tables_ptr = base + 4 * tables_offset``."""

    host: np.ndarray
    work_offset: int
    tables_offset: int
    table_stride: int


def pack_prefill_inputs(plan: PrefillPlan, page_tables: Sequence[np.ndarray], table_stride: int = 0) -> PrefillInputs:
    """Work list + page tables of ``plan`` as one int32 array (see :class:`PrefillInputs`). ``table_stride``
    (ints) defaults to the longest table; every table must cover :meth:`PrefillPlan.pages_needed` pages."""
    if len(page_tables) != plan.num_seqs:
        raise PrefillAttentionError(f"{len(page_tables)} page tables for {plan.num_seqs} sequences")
    tabs = [np.asarray(t, np.int64).reshape(-1) for t in page_tables]
    for s, t in enumerate(tabs):
        if len(t) < plan.pages_needed(s):
            raise PrefillAttentionError(f"page table {s} has {len(t)} pages, positions 0.."
                                        f"{plan.start_pos[s] + plan.q_lens[s] - 1} need {plan.pages_needed(s)}")
        if t.size and (t.min() < 0 or t.max() > np.iinfo(np.int32).max):
            raise IndexError(f"page table {s}: page index does not fit int32")
    longest = max((len(t) for t in tabs), default=1)
    stride = int(table_stride) or max(1, longest)
    if longest > stride:
        raise PrefillAttentionError(f"a page table of {longest} pages does not fit the stride {stride}")
    nw = plan.n_work * WORK_INTS
    toff = -(-nw // ALIGN_INTS) * ALIGN_INTS
    host = np.zeros(toff + plan.num_seqs * stride, np.int32)
    host[:nw] = plan.work.reshape(-1)
    for s, t in enumerate(tabs):
        host[toff + s * stride:toff + s * stride + len(t)] = t
    return PrefillInputs(host, 0, toff, stride)


def prefill_launch(plan: PrefillPlan, *, q: int, k: int, v: int, tables: int, table_stride: int, work: int,
                   out: int) -> Launch:
    """The launch of ``plan`` (pointers are device addresses); programmatic dependent (PDL): it may be
    scheduled under the previous kernel's tail and waits in-kernel (``griddepcontrol.wait``) before reading."""
    args = [("ptr", q), ("ptr", k), ("ptr", v), ("ptr", tables), ("i32", table_stride), ("ptr", work),
            ("ptr", out), ("i32", plan.num_q_heads), ("i32", plan.num_kv_heads), ("i32", plan.page_size),
            ("i32", plan.n_work), ("f32", plan.scale_log2)]
    return Launch(plan.variant.entry, plan.grid, plan.block, plan.smem_bytes, args, pdl=True)


def resolve_impl(impl: str, compute_capability: tuple[int, int], dtype: str, head_dim: int, group: int,
                 m_tiles: int | None = None, warps: int | None = None) -> str:
    """``impl`` (:data:`IMPLS`) resolved for a device: ``"auto"`` is :data:`AUTO_IMPL` on compute capability 9.0
    for the shapes it takes (:func:`wgmma_takes`) when no mma.sync schedule was asked for (``m_tiles`` /
    ``warps``), else ``"mma"``. :class:`PrefillAttentionError` for a wgmma build off compute capability 9.0."""
    if impl not in IMPLS:
        raise PrefillAttentionError(f"impl must be one of {IMPLS}, got {impl!r}")
    on_hopper = tuple(compute_capability) == (9, 0)
    if impl in WGMMA_IMPLS and not on_hopper:
        raise PrefillAttentionError(f"impl {impl!r} needs compute capability 9.0, not {tuple(compute_capability)}")
    if impl == "auto":
        auto_ok = on_hopper and wgmma_takes(dtype, head_dim, group) and m_tiles is None and warps is None
        return AUTO_IMPL if auto_ok else "mma"
    return impl


class CudaPrefillAttention:
    """The prefill-attention kernel of one ``(dtype, head_dim, group)`` on one device (``m_tiles`` / ``warps``:
    override the default mma.sync build, see :func:`choose_prefill_variant`; ``impl``: ``"auto"`` (default),
    ``"mma"``, ``"wgmma"`` or ``"wgmma_ws"``, see :func:`resolve_impl`; ``pv_split``: the wgmma builds' n64 P V
    products).

    The variant is compiled and loaded at construction and its dynamic-shared-memory opt-in is set once (all
    the device allows), so every plan :func:`plan_prefill` accepts for ``device.limits`` can launch. Under
    ``"auto"``, a wgmma build that fails to compile or load is logged and the mma.sync build runs.
    """

    def __init__(self, device: CudaDevice, dtype: str, head_dim: int, group: int, m_tiles: int | None = None,
                 warps: int | None = None, impl: str = "auto", pv_split: bool = False) -> None:
        self.device = device
        want = resolve_impl(impl, device.compute_capability, dtype, head_dim, group, m_tiles, warps)
        if want in WGMMA_IMPLS:
            try:
                self._load(choose_prefill_variant(dtype, head_dim, group, impl=want, pv_split=pv_split))
                return
            except Exception:
                if impl != "auto":
                    raise
                log.exception("the wgmma prefill attention did not build; the mma.sync build runs")
        self._load(choose_prefill_variant(dtype, head_dim, group, m_tiles, warps))

    def _load(self, v: PrefillVariant) -> None:
        module = load_module(v.source, v.options, v.arch or self.device.arch)
        kernel: Kernel = module.kernel(v.entry)
        if kernel.optin_bytes(self.device) is None:
            kernel.set_max_dynamic_smem(self.device)
        self.variant: PrefillVariant = v
        self.kernel: Kernel = kernel

    @property
    def impl(self) -> str:
        """The build this kernel runs: ``"mma"``, ``"wgmma"`` or ``"wgmma_ws"``."""
        return self.variant.impl

    @property
    def limits(self) -> DeviceLimits:
        return self.device.limits

    def plan(self, q_lens: Sequence[int], start_pos: Sequence[int], *, num_q_heads: int, num_kv_heads: int,
             page_size: int) -> PrefillPlan:
        """:func:`plan_prefill` for this variant on this device."""
        if num_q_heads // max(1, num_kv_heads) != self.variant.group:
            raise PrefillAttentionError(f"group {num_q_heads}/{num_kv_heads} but this kernel is built for "
                                        f"G = {self.variant.group}")
        return plan_prefill(q_lens, start_pos, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                            head_dim=self.variant.head_dim, dtype=self.variant.dtype, page_size=page_size,
                            limits=self.limits, m_tiles=self.variant.m_tiles, warps=self.variant.warps,
                            impl=self.variant.impl, pv_split=self.variant.pv_split)

    def launch(self, plan: PrefillPlan, q_ptr: int, k_pool_ptr: int, v_pool_ptr: int, tables_ptr: int,
               table_stride: int, work_ptr: int, out_ptr: int, *, pool_pages: int | None = None) -> None:
        """Launch ``plan`` on inputs already on the device: q ``[n_tokens, Hq, hd]``, pools
        ``[pages, page_size, Hkv, hd]``, tables / work list as :func:`pack_prefill_inputs` lays them out, out
        float32 ``[n_tokens, Hq, hd]``. No host work but the argument packing; nothing is launched when
        ``plan.n_work == 0``. ``work_ptr`` must be 16-byte aligned. ``pool_pages``: when given, checked
        against the kernel's 32-bit row index."""
        if plan.variant != self.variant:
            raise PrefillAttentionError(f"plan for {plan.variant}, kernel built for {self.variant}")
        if pool_pages is not None and pool_pages * plan.page_size * plan.num_kv_heads >= 2**31:
            raise PrefillAttentionError(f"KV pool of {pool_pages * plan.page_size * plan.num_kv_heads} rows: the "
                                        "kernel indexes rows with 32 bits")
        if work_ptr % 16:
            raise PrefillAttentionError(f"work_ptr 0x{work_ptr:x}: the kernel reads work items as int4 (16-byte "
                                        "aligned; put the work list at a multiple of 4 ints)")
        if plan.n_work == 0:
            return
        self.kernel.run(self.device, prefill_launch(plan, q=q_ptr, k=k_pool_ptr, v=v_pool_ptr, tables=tables_ptr,
                                                    table_stride=table_stride, work=work_ptr, out=out_ptr))

    def run(self, q: DeviceArray, k_pool: DeviceArray, v_pool: DeviceArray, page_tables: Sequence[np.ndarray],
            q_lens: Sequence[int], start_pos: Sequence[int]) -> DeviceArray:
        """Plan, upload the work list and tables, launch; returns float32 ``[n_tokens, Hq, hd]`` (tests and
        benchmarks; the backend packs :func:`pack_prefill_inputs` into its own step upload and calls
        :meth:`launch`)."""
        for name, a in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
            if not isinstance(a, DeviceArray):
                raise TypeError(f"{name} must be a DeviceArray, got {type(a).__name__}")
            if a.dtype.name != self.variant.dtype:
                raise PrefillAttentionError(f"{name} is {a.dtype.name}, this kernel is built for {self.variant.dtype}")
        n_tokens, hq, hd = q.shape
        pages, page_size, hkv, hd_k = k_pool.shape
        if v_pool.shape != k_pool.shape or hd_k != hd:
            raise PrefillAttentionError(f"pool shapes {k_pool.shape} / {v_pool.shape} do not match q {q.shape}")
        p = self.plan(q_lens, start_pos, num_q_heads=hq, num_kv_heads=hkv, page_size=page_size)
        if p.num_tokens != n_tokens:
            raise PrefillAttentionError(f"q has {n_tokens} rows, q_lens sum to {p.num_tokens}")
        packed = pack_prefill_inputs(p, page_tables)
        meta = self.device.upload(packed.host, stream_ordered=True)
        out = self.device.empty((n_tokens, hq, hd), "float32", stream_ordered=True)
        self.launch(p, q.ptr, k_pool.ptr, v_pool.ptr, meta.ptr + 4 * packed.tables_offset, packed.table_stride,
                    meta.ptr + 4 * packed.work_offset, out.ptr, pool_pages=pages)
        out.owner = (out.owner, meta)  # the upload lives as long as the output (stream-ordered frees)
        return out
