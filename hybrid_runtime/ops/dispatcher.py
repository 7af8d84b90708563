"""Guarded decode-attention dispatcher (DESIGN.md invariant 6).

Answers the TensorRT-LLM field crash: split-KV ("XQA multi-block") decode attention failing with
``CUDA_ERROR_INVALID_VALUE`` from ``cuLaunchKernelEx``. Every launch goes plan -> validate against the
*current* device's limits and the workspace -> fall back (halve blocks, then single-block) -> launch.
The only call into a kernel sits right after ``validate`` returned no reasons.

Grid layout. Attention kernel: x = blocks_per_seq (chunks), y = num_kv_heads, z = batch; one CTA
handles the whole GQA group of a kv head, so K/V are read once per group. Reduction kernel
(multi-block only): x = batch, y = num_q_heads, z = 64-wide slices of head_dim. Chunks are whole
multiples of ``CHUNK_ALIGN`` tokens, so a plan may use fewer chunks than the heuristic asked for.

Supported: head_dim a multiple of 16 in 16..256 (covers 64, 80, 96, 128, 160, 192, 256), dtype
float32 / float16 / bfloat16, beam width 1.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import Literal

import numpy as np

from .attention import decode_attention_multi, decode_attention_single

log = logging.getLogger("hybrid_runtime.dispatcher")

SINGLE, MULTI = "single_block", "multi_block"
Mode = Literal["auto", "on", "off"]
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Shortest chunk worth a CTA of its own: 64 tokens = one 16-token block per warp of the tensor-core kernel
# (on the H200 a 1k context decodes fastest split 16 ways; benchmarks/results/decode_attention_h200.md).
MIN_CHUNK_TOKENS = 64
MAX_BLOCKS_PER_SEQ = 128  # bounds the merge width and the workspace
# Resident CTAs per SM the plan counts on. A wave of more co-resident CTAs only splits the same memory
# bandwidth, while a second partial wave costs a whole extra chunk time.
MAX_CTAS_PER_SM = 2
SMEM_RESERVED_PER_CTA = 1024  # shared memory the driver reserves per resident CTA (sm_80 and later)
# Tokens of K/V staged in shared memory per CTA, largest that fits wins. The tensor-core kernel splits the
# staging area into per-warp rings of 16-token stages (192 = 4 warps x 3 stages: 3 blocks in flight per warp).
KV_TILES = (192, 128, 64, 32, 16)
# The LSE reduction kernel: CTAs of 16-thread groups, each CTA merging 64 head_dim columns (16 float4 lanes);
# a thread loads 8 chunks per round trip to L2. It is built for 8 groups (128 threads) and for 16 (256).
REDUCE_LANES = 16
REDUCE_BATCH = 8
REDUCE_GROUPS = (8, 16)
REDUCE_DIMS_PER_CTA = 4 * REDUCE_LANES
# Chunks are whole multiples of this many tokens (one 16-token block per warp of the tensor-core kernel),
# so only a sequence's last chunk can end inside a block (on the H200, 64 aligned chunks of a 32k context
# decode faster than 66 ragged ones).
CHUNK_ALIGN = 64
# The batch-invariant split (DecodeAttentionDispatcher.batch_invariant): a sequence of n tokens is cut into
# chunks of sequence_chunk(n) tokens, at most this many, whatever else shares the step.
SEQ_CHUNKS = 64
BLOCK_THREADS = 128  # 4 warps per attention CTA
# Batches of at least this many sequences are checked and split with numpy over all of them at once; smaller ones
# one sequence at a time in Python, where that is faster than numpy's fixed cost per call (same results either way;
# on this project's CPUs the loops win up to about 8-12 sequences: benchmarks/host_prepare_cpu.py)
VECTOR_MIN = 16
# Reasons a smaller split can cure; any other reason on a multi-block plan jumps straight to single-block.
BLOCK_REASONS = frozenset({"grid_x", "workspace"})
# Reasons about the batch itself: no plan can cure them, so the dispatcher raises at once.
BATCH_REASONS = frozenset({"beam_width", "dtype", "head_dim", "gqa", "context_len", "page_table", "page_index"})


class DecodeAttentionError(RuntimeError):
    """No valid launch exists for this batch; ``reasons`` holds the stable reason codes."""

    def __init__(self, message: str, reasons: Sequence[str]) -> None:
        super().__init__(message)
        self.reasons = tuple(reasons)


@dataclass(frozen=True)
class DeviceLimits:
    """Launch limits of one device. ``optin_set``: kernels whose dynamic-shared-memory opt-in attribute
    (``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``) was set *on this device*; it is per device,
    so on multi-GPU each device needs its own ``DeviceLimits``."""

    name: str
    sm_count: int
    max_grid_x: int = 2**31 - 1
    max_grid_y: int = 65535
    max_grid_z: int = 65535
    max_threads_per_block: int = 1024
    max_shared_mem_per_block: int = 48 * 1024
    max_shared_mem_optin: int = 227 * 1024
    max_shared_mem_per_sm: int = 228 * 1024
    optin_set: frozenset[str] = frozenset()
    # Shortest chunk worth splitting off: a tuning figure of the device's kernels, not a launch limit.
    min_chunk_tokens: int = MIN_CHUNK_TOKENS

    @classmethod
    def cpu(cls) -> DeviceLimits:
        """The numpy backend as a simulated Hopper-like device: one "SM" per core, so ``auto`` splits
        only when the batch cannot keep the cores busy; both kernels count as opted in. numpy chunks
        have little fixed cost, so chunks of 32 tokens are allowed (``on`` then splits short contexts
        too, which is what makes the CPU tests of the multi-block path meaningful)."""
        return cls("cpu-numpy", sm_count=os.cpu_count() or 1, optin_set=frozenset({SINGLE, MULTI}),
                   min_chunk_tokens=32)

    def with_optin(self, *kernels: str) -> DeviceLimits:
        return replace(self, optin_set=self.optin_set | frozenset(kernels))


_limits_cache: dict[Hashable, DeviceLimits] = {}
_limits_lock = threading.Lock()


def limits_for(device_key: Hashable, query_fn: Callable[[], DeviceLimits]) -> DeviceLimits:
    """Limits of ``device_key`` (e.g. a CUDA ordinal), queried once per device and cached."""
    with _limits_lock:
        if device_key not in _limits_cache:
            _limits_cache[device_key] = query_fn()
        return _limits_cache[device_key]


def _frozen_table(table: Sequence[int] | np.ndarray) -> np.ndarray:
    t = np.array(table, dtype=np.int64).reshape(-1)
    t.setflags(write=False)
    return t


@dataclass(frozen=True, eq=False)
class DecodeBatch:
    """What the planner needs to know about one decode step of one attention layer.

    ``context_lens[b]`` includes the new token; ``page_tables[b]`` (int array) must cover it.
    """

    context_lens: tuple[int, ...]
    page_tables: tuple[np.ndarray, ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    num_pool_pages: int
    beam_width: int = 1

    @classmethod
    def from_arrays(cls, q: np.ndarray, k_buf: np.ndarray, page_tables: Sequence,
                    context_lens: Sequence[int] | np.ndarray, beam_width: int = 1) -> DecodeBatch:
        """From q ``[B, H, hd]`` and a pool ``[num_pages, page_size, Hkv, hd]``. Tables are copied
        read-only, so what was validated is exactly what the kernel reads."""
        return cls(tuple(int(n) for n in np.asarray(context_lens).reshape(-1)),
                   tuple(_frozen_table(t) for t in page_tables),
                   q.shape[1], k_buf.shape[2], q.shape[2], k_buf.shape[1], k_buf.dtype.name,
                   k_buf.shape[0], beam_width)

    @property
    def batch_size(self) -> int:
        return len(self.context_lens)

    @property
    def group(self) -> int:
        return self.num_q_heads // max(1, self.num_kv_heads)

    @cached_property
    def problems(self) -> tuple[str, ...]:
        """Reasons no plan can launch this batch (computed once: it checks every page table, all at once)."""
        r = []
        if self.beam_width != 1:
            r.append("beam_width")
        if self.dtype not in DTYPE_BYTES:
            r.append("dtype")
        if not (16 <= self.head_dim <= 256 and self.head_dim % 16 == 0):
            r.append("head_dim")
        if self.num_kv_heads < 1 or self.num_q_heads % self.num_kv_heads:
            r.append("gqa")
        if self.context_lens and min(self.context_lens) < 1:
            r.append("context_len")
        tables = self._table_problems()
        r += self._table_problems_loop() if tables is None else tables
        return tuple(dict.fromkeys(r))

    @cached_property
    def lens_array(self) -> np.ndarray | None:
        """``context_lens`` as a read-only int64 array (None when they do not fit one: callers walk the tuple)."""
        try:
            a = np.array(self.context_lens, np.int64)
        except (OverflowError, TypeError, ValueError):
            return None
        if a.shape != (len(self.context_lens),):
            return None
        a.setflags(write=False)
        return a

    @cached_property
    def padded_tables(self) -> tuple[np.ndarray, np.ndarray] | None:
        """:func:`padded_tables` of ``page_tables`` (computed once per batch)."""
        return padded_tables(self.page_tables)

    def seq_chunks(self, limits: DeviceLimits) -> tuple[tuple[int, ...], np.ndarray | None]:
        """Every sequence's :func:`sequence_chunk` under ``limits``, as a tuple and as an int64 array (None when
        the batch is short or its lengths do not fit one), computed once per batch and chunking rule."""
        chunks, arr, _ = self._split(limits)
        return chunks, arr

    def _split(self, limits: DeviceLimits) -> tuple[tuple[int, ...], np.ndarray | None, int]:
        """(chunks, chunks as an array or None, chunks the longest-split sequence needs, at least 2) of
        :func:`sequence_plan`, once per batch and chunking rule."""
        memo = self.__dict__.setdefault("_split_memo", {})
        key = limits.min_chunk_tokens
        hit = memo.get(key)
        if hit is None:
            lens = self.lens_array if len(self.context_lens) >= VECTOR_MIN else None
            if lens is None:
                chunks = tuple(sequence_chunk(n, limits) for n in self.context_lens)
                need = max([2, *(-(-max(n, 1) // c) for n, c in zip(self.context_lens, chunks))])
                hit = memo[key] = (chunks, None, need)
            else:
                c = sequence_chunks(lens, limits)
                c.setflags(write=False)
                need = max(2, int((-(-np.maximum(lens, 1) // c)).max(initial=0)))
                hit = memo[key] = (tuple(c.tolist()), c, need)
        return hit

    def _table_problems_loop(self) -> list[str]:
        """"page_table" / "page_index" by walking the tables one by one (any table :func:`padded_tables` takes
        not)."""
        r = []
        for n, table in zip(self.context_lens, self.page_tables):
            used = table[:-(-max(n, 0) // self.page_size)]  # the ceil(n / page_size) pages a kernel reads
            if len(used) * self.page_size < n:
                r.append("page_table")
            if used.size and (used.min() < 0 or used.max() >= self.num_pool_pages):
                r.append("page_index")  # a negative index would even wrap silently in numpy
        return r

    def _table_problems(self) -> list[str] | None:
        """:meth:`_table_problems_loop`'s answer (the same reasons in the same first-seen order) over all tables at
        once; None when the batch is not one it can take (then the loop runs)."""
        if len(self.context_lens) < VECTOR_MIN:
            return None
        ps, lens = self.page_size, self.lens_array
        if (lens is None or len(self.page_tables) != len(lens) or type(ps) is not int or not 0 < ps < 1 << 31
                or type(self.num_pool_pages) is not int or not 0 <= self.num_pool_pages < 1 << 62):
            return None
        pt = self.padded_tables
        if pt is None:
            return None
        mat, tl = pt
        used = np.minimum(-(-np.maximum(lens, 0) // ps), tl)  # the ceil(n / page_size) pages a kernel reads
        short = used * ps < lens
        cols = np.arange(mat.shape[1])
        bad = ((mat < 0) | (mat >= self.num_pool_pages)) & (cols < used[:, None])
        bad_seq = bad.any(axis=1)
        first_short = int(short.argmax()) if short.any() else -1
        first_bad = int(bad_seq.argmax()) if bad_seq.any() else -1
        if first_short < 0:
            return ["page_index"] if first_bad >= 0 else []
        if first_bad < 0:
            return ["page_table"]
        return ["page_table", "page_index"] if first_short <= first_bad else ["page_index", "page_table"]


def padded_tables(tables: Sequence) -> tuple[np.ndarray, np.ndarray] | None:
    """Page tables as one zero-padded int64 matrix ``[B, max(1, longest)]`` and their lengths ``[B]``: what the
    batch-wide checks and the upload packing read instead of walking the tables one by one. None unless every
    table is a 1-D array (or list) of integers that int64 holds exactly (callers then walk the tables)."""
    B = len(tables)
    try:
        lens = np.fromiter(map(len, tables), np.int64, count=B)
        flat = np.concatenate(tables) if B else np.zeros(0, np.int64)
    except (TypeError, ValueError, OverflowError):
        return None
    if flat.ndim != 1 or flat.size != int(lens.sum()) or not (
            flat.dtype.kind == "i" or (flat.dtype.kind == "u" and flat.dtype.itemsize < 8)):
        return None
    width = max(1, int(lens.max())) if B else 1
    mat = np.zeros((B, width), np.int64)
    mat[np.arange(width) < lens[:, None]] = flat
    return mat, lens


@dataclass(frozen=True)
class LaunchPlan:
    """One validated-or-not launch: attention kernel + (multi-block only) the LSE reduction kernel."""

    kernel: str  # "single_block" | "multi_block"
    blocks_per_seq: int
    grid: tuple[int, int, int]
    block_threads: int
    smem_bytes: int  # dynamic shared memory of the attention kernel
    kv_tile: int  # tokens of K/V staged in shared memory per step
    chunk_len: int  # tokens per chunk (blocks_per_seq chunks cover the longest sequence)
    workspace_bytes: int  # partials: B * Hq * blocks * (hd + 2) * 4; 0 for single-block
    reduce_grid: tuple[int, int, int] | None = None
    reduce_threads: int = 0
    # the batch-invariant split (sequence_plan): each sequence's own chunk length (chunk_len is their max);
    # the kernels read them from device memory (kernel argument chunk_len = -1)
    seq_chunks: tuple[int, ...] | None = None


def smem_bytes(group: int, head_dim: int, dtype_bytes: int, kv_tile: int) -> int:
    """Dynamic shared memory of one CTA: Q of the GQA group, a K and a V tile, the tile's logits and
    the float32 accumulators (hd + max + sum per query head), plus 4 floats of row padding per query head
    (the tensor-core kernel's merge rows are hd + 4 long; with them the area always holds its merge)."""
    return (group * head_dim * dtype_bytes + 2 * kv_tile * head_dim * dtype_bytes
            + group * kv_tile * 4 + group * (head_dim + 2) * 4 + group * 16)


def partials_bytes_per_block(batch: DecodeBatch) -> int:
    """Workspace one chunk of every sequence needs: float32 output, max and sum-exp per query head."""
    return batch.batch_size * batch.num_q_heads * (batch.head_dim + 2) * 4


def make_plan(batch: DecodeBatch, blocks: int, limits: DeviceLimits) -> LaunchPlan:
    """Concrete plan for ``blocks`` chunks per sequence (1 = single-block)."""
    longest = max(batch.context_lens, default=0)
    blocks = max(1, blocks) if longest > 0 else 1  # nothing to split (such a batch fails validation anyway)
    chunk = -(-longest // blocks)
    if blocks > 1:  # aligned chunks; alignment may leave fewer (never more) chunks than asked for
        align = max(1, min(CHUNK_ALIGN, limits.min_chunk_tokens))
        chunk = -(-chunk // align) * align
        blocks = max(1, -(-longest // chunk))
    kernel = SINGLE if blocks <= 1 else MULTI
    B, hq, hd = batch.batch_size, batch.num_q_heads, batch.head_dim
    es = DTYPE_BYTES.get(batch.dtype, 4)
    # Largest K/V tile whose shared memory fits this kernel's cap; the smallest if none does (the
    # guard then rejects it). Tiles never exceed the chunk: a short chunk needs no big staging area.
    cap = limits.max_shared_mem_optin if kernel in limits.optin_set else limits.max_shared_mem_per_block
    tiles = [min(t, max(16, chunk)) for t in KV_TILES]
    tile = next((t for t in tiles if smem_bytes(batch.group, hd, es, t) <= cap), tiles[-1])
    multi = kernel == MULTI
    return LaunchPlan(kernel, blocks, (blocks, batch.num_kv_heads, B), BLOCK_THREADS,
                      smem_bytes(batch.group, hd, es, tile), tile, chunk,
                      partials_bytes_per_block(batch) * blocks if multi else 0,
                      (B, hq, -(-hd // REDUCE_DIMS_PER_CTA)) if multi else None,
                      reduce_threads(blocks) if multi else 0)


def fixed_grid_plan(batch: DecodeBatch, blocks: int, limits: DeviceLimits) -> LaunchPlan:
    """A plan whose launch geometry depends only on (batch size, ``blocks``), for CUDA graphs: exactly
    ``blocks`` chunks (trailing ones may be empty), the largest K/V tile whose shared memory fits whatever the
    chunk, and the chunk length (the only part that follows the contexts) a kernel argument of 0 that the
    kernels read from device memory. ``validate`` checks it like any plan."""
    longest = max(batch.context_lens, default=0)
    blocks = max(1, int(blocks))
    chunk = -(-longest // blocks)
    if blocks > 1:
        align = max(1, min(CHUNK_ALIGN, limits.min_chunk_tokens))
        chunk = -(-chunk // align) * align
    kernel = SINGLE if blocks == 1 else MULTI
    B, hq, hd = batch.batch_size, batch.num_q_heads, batch.head_dim
    es = DTYPE_BYTES.get(batch.dtype, 4)
    cap = limits.max_shared_mem_optin if kernel in limits.optin_set else limits.max_shared_mem_per_block
    tile = next((t for t in KV_TILES if smem_bytes(batch.group, hd, es, t) <= cap), KV_TILES[-1])
    multi = kernel == MULTI
    return LaunchPlan(kernel, blocks, (blocks, batch.num_kv_heads, B), BLOCK_THREADS,
                      smem_bytes(batch.group, hd, es, tile), tile, chunk,
                      partials_bytes_per_block(batch) * blocks if multi else 0,
                      (B, hq, -(-hd // REDUCE_DIMS_PER_CTA)) if multi else None,
                      reduce_threads(blocks) if multi else 0)


def sequence_chunk(context_len: int, limits: DeviceLimits) -> int:
    """Tokens per chunk of one sequence under the batch-invariant split: ``ceil(n / SEQ_CHUNKS)`` rounded up to
    the chunk alignment, at least ``limits.min_chunk_tokens`` — a function of the sequence's own length ``n``
    (and the device), never of the other sequences of the step."""
    align = max(1, min(CHUNK_ALIGN, limits.min_chunk_tokens))
    c = max(limits.min_chunk_tokens, -(-max(1, int(context_len)) // SEQ_CHUNKS), 1)
    return -(-c // align) * align


def sequence_chunks(context_lens: np.ndarray, limits: DeviceLimits) -> np.ndarray:
    """:func:`sequence_chunk` of every length in ``context_lens`` (int64 array), all at once."""
    align = max(1, min(CHUNK_ALIGN, limits.min_chunk_tokens))
    c = np.maximum(-(-np.maximum(context_lens, 1) // SEQ_CHUNKS), max(limits.min_chunk_tokens, 1))
    return -(-c // align) * align


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (max(1, int(n)) - 1).bit_length()


def sequence_plan(batch: DecodeBatch, limits: DeviceLimits, blocks: int = 0) -> LaunchPlan:
    """The batch-invariant split: sequence b in chunks of ``sequence_chunk(len_b)`` tokens, the multi-block
    kernels always (at least 2 chunks in the grid; a short sequence's second one is empty), the largest K/V tile
    that fits whatever the chunk, and the merge's CTA size fixed by :data:`SEQ_CHUNKS`. So a sequence's chunks,
    tile and merge order, hence the bits of its output, follow its own length only: empty trailing chunks add
    exact zeros in the merge (decode_attention.cu). ``blocks``: the grid's chunks (0: the fewest that cover every
    sequence; a graph class passes its power of two). ``validate`` checks it like any plan."""
    chunks, _, need = batch._split(limits)
    blocks = max(int(blocks), 0) or need
    memo = batch.__dict__.setdefault("_plan_memo", {})  # the same plan object for the same arguments
    hit = memo.get((id(limits), blocks))
    if hit is not None and hit[0] is limits:
        return hit[1]
    B, hq, hd = batch.batch_size, batch.num_q_heads, batch.head_dim
    es = DTYPE_BYTES.get(batch.dtype, 4)
    cap = limits.max_shared_mem_optin if MULTI in limits.optin_set else limits.max_shared_mem_per_block
    tile, smem = _largest_tile(batch.group, hd, es, cap)
    p = LaunchPlan(MULTI, blocks, (blocks, batch.num_kv_heads, B), BLOCK_THREADS, smem, tile, max(chunks, default=1),
                   partials_bytes_per_block(batch) * blocks, (B, hq, -(-hd // REDUCE_DIMS_PER_CTA)),
                   _SEQ_REDUCE_THREADS, chunks)
    memo[(id(limits), blocks)] = (limits, p)
    return p


@lru_cache(maxsize=256)
def _largest_tile(group: int, head_dim: int, dtype_bytes: int, cap: int) -> tuple[int, int]:
    """(the largest K/V tile whose shared memory fits ``cap`` — the smallest if none does —, its shared memory)."""
    tile = next((t for t in KV_TILES if smem_bytes(group, head_dim, dtype_bytes, t) <= cap), KV_TILES[-1])
    return tile, smem_bytes(group, head_dim, dtype_bytes, tile)


def graph_blocks(blocks: int) -> int:
    """The plan class of a chunk count for graphs: the largest power of two not above it (1 = single-block),
    so a bucket needs at most log2(MAX_BLOCKS_PER_SEQ) + 1 graphs."""
    return 1 << (max(1, int(blocks)).bit_length() - 1)


def reduce_threads(blocks: int) -> int:
    """Threads of a reduction CTA merging ``blocks`` chunks: 8 groups up to 64 chunks, 16 groups above, so
    every chunk's loads go out in one round trip. On the H200 the 128-thread CTA merges 64 chunks 0.1-0.2 µs
    sooner than a 256-thread one (benchmarks/results/decode_attention_notes.md)."""
    groups = next((g for g in REDUCE_GROUPS if g * REDUCE_BATCH >= blocks), REDUCE_GROUPS[-1])
    return REDUCE_LANES * groups


_SEQ_REDUCE_THREADS = reduce_threads(SEQ_CHUNKS)  # the sequence split's merge CTA


def resident_ctas_per_sm(batch: DecodeBatch, limits: DeviceLimits) -> int:
    """Attention CTAs of this batch one SM holds at once, by shared memory (1..MAX_CTAS_PER_SM)."""
    need = make_plan(batch, 1, limits).smem_bytes + SMEM_RESERVED_PER_CTA
    return max(1, min(MAX_CTAS_PER_SM, limits.max_shared_mem_per_sm // need))


def plan(batch: DecodeBatch, mode: Mode, limits: DeviceLimits, workspace_capacity: int) -> LaunchPlan:
    """Choose blocks per sequence: as many chunks as make ``B * Hkv * blocks`` CTAs fill one wave
    (``sm_count`` x resident CTAs per SM, never more: a partial second wave costs a whole chunk time),
    with chunks of at least ``limits.min_chunk_tokens`` of the longest context. ``auto`` splits only when
    that gives >= 2 chunks (``B * Hkv`` CTAs alone leave at least half the wave idle), capped by grid x and
    workspace. ``on`` splits whenever there are >= 2 chunks' worth of tokens and leaves the device caps to
    the guard. ``off`` never splits."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"multi_block_mode must be auto|on|off, got {mode!r}")
    ctas = max(1, batch.batch_size * batch.num_kv_heads)
    wave = limits.sm_count * resident_ctas_per_sm(batch, limits)
    by_ctx = max(batch.context_lens, default=0) // max(1, limits.min_chunk_tokens)
    blocks = min(by_ctx, MAX_BLOCKS_PER_SEQ, max(2, wave // ctas))
    if mode == "off" or by_ctx < 2:
        blocks = 1
    elif mode == "auto":
        per_block = max(1, partials_bytes_per_block(batch))
        blocks = 1 if wave // ctas < 2 else min(blocks, limits.max_grid_x, workspace_capacity // per_block)
    return make_plan(batch, blocks, limits)


def validate(p: LaunchPlan, batch: DecodeBatch, limits: DeviceLimits, workspace_capacity: int) -> list[str]:
    """Every reason ``p`` would be an invalid (or wrong) launch for ``batch`` on this device; [] if none. A function
    of its (immutable) arguments only, so the answer for the same plan, limits and workspace is kept on the batch."""
    memo = batch.__dict__.setdefault("_valid_memo", {})
    key = (id(p), id(limits), workspace_capacity)
    hit = memo.get(key)
    if hit is not None and hit[0] is p and hit[1] is limits:
        return list(hit[2])
    r = _validate(p, batch, limits, workspace_capacity)
    memo[key] = (p, limits, tuple(r))
    return r


_REDUCE_THREADS = tuple(g * REDUCE_LANES for g in REDUCE_GROUPS)  # the reduction kernel's builds


def _validate(p: LaunchPlan, batch: DecodeBatch, limits: DeviceLimits, workspace_capacity: int) -> list[str]:
    r = list(batch.problems)
    multi = p.kernel == MULTI
    if p.kernel not in (SINGLE, MULTI) or p.blocks_per_seq < 1 or multi != (p.blocks_per_seq > 1) \
            or p.grid != (p.blocks_per_seq, batch.num_kv_heads, batch.batch_size) \
            or multi != (p.reduce_grid is not None):
        r.append("plan_inconsistent")
    if p.blocks_per_seq * p.chunk_len < max(batch.context_lens, default=0):
        r.append("plan_inconsistent")  # chunks that do not cover a sequence would drop tokens
    if p.seq_chunks is not None and (
            len(p.seq_chunks) != batch.batch_size or not multi or _chunks_short(p, batch)):
        r.append("plan_inconsistent")  # every sequence's own chunks must fit the grid
    g, rg = p.grid, p.reduce_grid
    if min(g, default=1) < 1 or (rg is not None and min(rg, default=1) < 1):
        r.append("grid_zero")
    for i, cap in enumerate((limits.max_grid_x, limits.max_grid_y, limits.max_grid_z)):
        if g[i] > cap or (rg is not None and rg[i] > cap):
            r.append("grid_" + "xyz"[i])
    if not 1 <= p.block_threads <= limits.max_threads_per_block \
            or (multi and not 1 <= p.reduce_threads <= limits.max_threads_per_block):
        r.append("threads")
    if multi and p.reduce_threads not in _REDUCE_THREADS:
        r.append("plan_inconsistent")  # the reduction kernel is built for these thread counts only
    es = DTYPE_BYTES.get(batch.dtype, 4)
    if p.smem_bytes < smem_bytes(batch.group, batch.head_dim, es, p.kv_tile):
        r.append("plan_inconsistent")  # a plan that under-sizes its own shared memory
    if p.smem_bytes > limits.max_shared_mem_optin:
        r.append("smem_optin")
    elif p.smem_bytes > limits.max_shared_mem_per_block and p.kernel not in limits.optin_set:
        r.append("smem_attr_not_set")
    need_ws = partials_bytes_per_block(batch) * p.blocks_per_seq if multi else 0
    if p.workspace_bytes < need_ws:
        r.append("plan_inconsistent")
    if max(p.workspace_bytes, need_ws) > workspace_capacity:
        r.append("workspace")
    return list(dict.fromkeys(r))  # de-duplicated, first-seen order


def _chunks_short(p: LaunchPlan, batch: DecodeBatch) -> bool:
    """Whether a sequence's own chunk length is < 1 or its ``blocks_per_seq`` chunks do not cover it (``p.seq_chunks``
    as long as the batch)."""
    assert p.seq_chunks is not None
    lens = batch.lens_array if len(p.seq_chunks) >= VECTOR_MIN else None
    if lens is not None and isinstance(p.blocks_per_seq, int) and 0 <= p.blocks_per_seq < 1 << 31:
        try:
            c = np.array(p.seq_chunks, np.int64)
        except (OverflowError, TypeError, ValueError):
            c = None
        if c is not None and c.shape == lens.shape and int(np.abs(c).max(initial=0)) < 1 << 31:
            return bool((c < 1).any() or (p.blocks_per_seq * c < lens).any())
    return any(c < 1 or p.blocks_per_seq * c < n for n, c in zip(batch.context_lens, p.seq_chunks))


Kernel = Callable[..., np.ndarray]  # kernel(plan, q, k_buf, v_buf, page_tables, context_lens) -> out


def numpy_kernels() -> dict[str, Kernel]:
    """The CPU kernels, behind the same ``kernel(plan, ...)`` signature a CUDA launcher implements."""
    return {SINGLE: lambda p, *a: decode_attention_single(*a),
            MULTI: lambda p, *a: decode_attention_multi(*a, blocks_per_seq=p.blocks_per_seq)}


@dataclass
class DecodeAttentionDispatcher:
    """Plans, guards and launches decode attention for one device. One per device (limits are per
    device); owned by the engine thread, like every cache. ``fallbacks`` counts every reason a
    candidate plan was rejected; ``errors`` the reasons of raised ``DecodeAttentionError``; ``plans``
    the launches by kernel name."""

    mode: Mode = "auto"
    limits: DeviceLimits = field(default_factory=DeviceLimits.cpu)
    workspace_capacity: int = 64 << 20
    kernels: Mapping[str, Kernel] = field(default_factory=numpy_kernels)
    # mode auto / on: split every sequence by its own length (sequence_plan) so its output does not depend on
    # the rest of the batch; a sequence plan the guard refuses falls back to the batch-dependent one (counted)
    batch_invariant: bool = False
    fallbacks: Counter = field(default_factory=Counter, init=False)
    errors: Counter = field(default_factory=Counter, init=False)
    plans: Counter = field(default_factory=Counter, init=False)
    _logged: set = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "on", "off"):
            raise ValueError(f"multi_block_mode must be auto|on|off, got {self.mode!r}")
        missing = {SINGLE, MULTI} - set(self.kernels)
        if missing:
            raise ValueError(f"kernels missing: {sorted(missing)}")

    def select(self, batch: DecodeBatch) -> LaunchPlan:
        """A plan that passes ``validate``, reducing on failure; raises ``DecodeAttentionError``. With
        ``batch_invariant`` (mode auto / on) the sequence plan first."""
        if self.batch_invariant and self.mode != "off":
            seq = sequence_plan(batch, self.limits)
            reasons = validate(seq, batch, self.limits, self.workspace_capacity)
            if not reasons:
                return seq
            self.fallbacks.update(f"sequence_split:{r}" for r in reasons)
        cand = plan(batch, self.mode, self.limits, self.workspace_capacity)
        while reasons := validate(cand, batch, self.limits, self.workspace_capacity):
            self.fallbacks.update(reasons)
            for reason in reasons:
                if reason not in self._logged:  # once per reason: a bad device would flood the log
                    self._logged.add(reason)
                    log.warning("decode attention: %s plan rejected on %s: %s (logged once per reason)",
                                cand.kernel, self.limits.name, reason)
            if cand.kernel == SINGLE or BATCH_REASONS.intersection(reasons):
                self.errors.update(reasons)
                raise DecodeAttentionError(
                    f"no valid decode-attention launch on {self.limits.name} for batch of "
                    f"{batch.batch_size} (Hq={batch.num_q_heads}, Hkv={batch.num_kv_heads}, "
                    f"hd={batch.head_dim}, {batch.dtype}, max ctx {max(batch.context_lens, default=0)}): "
                    f"{', '.join(reasons)}", reasons)
            halve = set(reasons) <= BLOCK_REASONS and cand.blocks_per_seq >= 4
            cand = make_plan(batch, cand.blocks_per_seq // 2 if halve else 1, self.limits)
        return cand

    def run(self, q: np.ndarray, k_buf: np.ndarray, v_buf: np.ndarray, page_tables: Sequence,
            context_lens: Sequence[int] | np.ndarray) -> np.ndarray:
        """Decode attention of q ``[B, Hq, hd]`` over pools ``[pages, page_size, Hkv, hd]`` -> ``[B, Hq, hd]``.

        The new token's K/V must already be written; ``context_lens[b]`` counts it.
        """
        if (q.ndim != 3 or k_buf.ndim != 4 or v_buf.shape != k_buf.shape or q.shape[2] != k_buf.shape[3]
                or len(page_tables) != q.shape[0] or len(context_lens) != q.shape[0]):
            self.errors["shape"] += 1
            raise DecodeAttentionError(f"inconsistent shapes: q {q.shape}, k {k_buf.shape}, v {v_buf.shape}, "
                                       f"{len(page_tables)} tables, {len(context_lens)} lengths", ["shape"])
        batch = DecodeBatch.from_arrays(q, k_buf, page_tables, context_lens)
        p = self.select(batch)
        # The one place a kernel is called: re-validated right here so no path can skip the guard.
        if reasons := validate(p, batch, self.limits, self.workspace_capacity):
            raise AssertionError(f"unvalidated plan reached launch: {reasons}")
        self.plans[p.kernel] += 1
        log.debug("decode attention plan %s", p)
        return self.kernels[p.kernel](p, q, k_buf, v_buf, batch.page_tables, batch.context_lens)
