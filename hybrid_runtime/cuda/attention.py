"""GPU decode attention behind :class:`~hybrid_runtime.ops.dispatcher.DecodeAttentionDispatcher`.

One :class:`CudaDecodeAttention` per device: it owns that device's workspace and kernels, reports the
device's real limits (``cuDeviceGetAttribute``) plus exactly the kernel families it opted in to on that
device, and implements the dispatcher's ``kernel(plan, q, k_buf, v_buf, page_tables, context_lens)`` for
both ``single_block`` and ``multi_block``. The plan the dispatcher validated is launched unchanged:
grid, block and dynamic shared memory come from it (:func:`attention_launches`).

Inputs are :class:`~hybrid_runtime.cuda.driver.DeviceArray`: q ``[B, Hq, hd]``, pools
``[pages, page_size, Hkv, hd]`` (float16 / bfloat16 / float32, q and pools alike). The page tables
and lengths the dispatcher froze are uploaded as int32 before the launch. Output: float32 ``[B, Hq, hd]``
(as the CPU kernels).

Kernel variants (compiled per dtype / head_dim / GQA width): ``mma`` (tensor cores, fp16/bf16 with
``head_dim * ceil(G/8) <= 256``) and ``simt`` (everything else, float32 included).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..ops.dispatcher import (
    MULTI,
    REDUCE_GROUPS,
    REDUCE_LANES,
    SINGLE,
    DecodeAttentionDispatcher,
    DeviceLimits,
    LaunchPlan,
    Mode,
    padded_tables,
)
from .driver import CudaDevice, DeviceArray, DeviceBuffer
from .kernels import Kernel, Launch, load_module

SOURCE = "decode_attention.cu"
DT_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
ENTRY = {SINGLE: "decode_attn_single", MULTI: "decode_attn_multi"}
# The LSE reduction's builds by CTA size (the plan's reduce_threads): 8 or 16 groups of 16 threads.
REDUCE_ENTRY = dict(zip((REDUCE_LANES * g for g in REDUCE_GROUPS), ("decode_attn_reduce", "decode_attn_reduce_wide"),
                        strict=True))
# entry point -> key of kernels_for()
FAMILY = {ENTRY[SINGLE]: SINGLE, ENTRY[MULTI]: MULTI, **{e: e for e in REDUCE_ENTRY.values()}}
MMA_THREADS = 128  # the tensor-core kernel is compiled with __launch_bounds__(128)
TABLE_ALIGN_INTS = 32  # page tables start on a 128-byte line (pack_tables)


@dataclass(frozen=True)
class Variant:
    impl: str  # "mma" | "simt"
    dtype: str
    head_dim: int
    ntiles: int = 1  # mma: 8-wide tiles of the GQA group

    @property
    def options(self) -> tuple[str, ...]:
        return (f"-DHD={self.head_dim}", f"-DDT={DT_CODES[self.dtype]}",
                f"-DIMPL={1 if self.impl == 'mma' else 0}", f"-DNT={self.ntiles}")


def choose_variant(dtype: str, head_dim: int, group: int, block_threads: int = MMA_THREADS) -> Variant:
    if dtype not in DT_CODES:
        raise ValueError(f"unsupported dtype {dtype}")
    nt = -(-group // 8)
    if dtype != "float32" and head_dim * nt <= 256 and block_threads == MMA_THREADS:
        return Variant("mma", dtype, head_dim, nt)
    return Variant("simt", dtype, head_dim, 1)


def attention_launches(p: LaunchPlan, *, batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                       page_size: int, q: int, k: int, v: int, tables: int, table_stride: int, lens: int,
                       out: int, workspace: int, device_chunk: bool = False) -> list[Launch]:
    """The launches of plan ``p`` (pointers are device addresses). Geometry is copied from the plan. Both
    kernels are programmatic dependent launches (a no-op before sm_90): each may be scheduled while the
    kernel before it on the stream still runs (once that kernel lets it in: the tensor-core attention
    kernel does so as its CTAs finish, the reduction right after its own wait), and waits in-kernel
    (``griddepcontrol.wait``) for it to finish before touching global memory, so its launch latency
    hides behind that kernel's tail."""
    nblk = p.blocks_per_seq
    args = [("ptr", q), ("ptr", k), ("ptr", v), ("ptr", tables), ("i32", table_stride), ("ptr", lens),
            ("ptr", out), ("ptr", workspace), ("i32", batch), ("i32", num_q_heads), ("i32", num_kv_heads),
            ("i32", page_size), ("i32", -1 if p.seq_chunks is not None else 0 if device_chunk else p.chunk_len),
            ("i32", nblk), ("i32", p.kv_tile),
            ("i32", p.smem_bytes),
            ("f32", math.log2(math.e) / math.sqrt(head_dim))]
    launches = [Launch(ENTRY[p.kernel], p.grid, (p.block_threads, 1, 1), p.smem_bytes, args, pdl=True)]
    if p.kernel == MULTI:
        assert p.reduce_grid is not None
        launches.append(Launch(REDUCE_ENTRY[p.reduce_threads], p.reduce_grid, (p.reduce_threads, 1, 1), 0,
                               [("ptr", workspace), ("ptr", out), ("i32", batch), ("i32", num_q_heads),
                                ("i32", nblk)], pdl=True))
    return launches


_INT32_MAX = int(np.iinfo(np.int32).max)
# pack_tables writes the tables as one matrix from this many up (one at a time below: numpy's fixed cost per call)
PACK_MATRIX_MIN = 6


def tables_offset(batch: int) -> int:
    """Where the page tables start in :func:`pack_tables`' layout (ints): after ``batch`` lengths, the
    chunk-length word and ``batch`` per-sequence chunk lengths, rounded up to a 128-byte line."""
    return -(-(2 * batch + 1) // TABLE_ALIGN_INTS) * TABLE_ALIGN_INTS


def pack_tables(page_tables: Sequence[np.ndarray], context_lens: Sequence[int], chunk_len: int = 0,
                stride: int = 0, seq_chunks: Sequence[int] | None = None,
                padded: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, int, int]:
    """Lengths and page tables in one int32 host array, for one upload: ``(host, tables_offset, stride)``.

    ``host[:B]`` = lengths, ``host[B]`` = ``chunk_len`` (what kernels launched with chunk length 0 read: a
    captured graph's plan keeps its grid while the chunk length is step data), ``host[B + 1 + b]`` = sequence
    b's own chunk length (``seq_chunks``, the batch-invariant split; kernels launched with -1 read it; 0 when
    not given); table ``b`` starts at
    ``tables_offset + b * stride`` (ints; stride = the longest table unless given, rows zero-padded). The
    tables start on a 128-byte line of their own (``tables_offset`` is a multiple of 32): on the H200, tables
    right behind the lengths (sharing their line) made batch 1 / 32k 0.6 µs slower.

    ``padded``: :func:`~hybrid_runtime.ops.dispatcher.padded_tables` of ``page_tables`` when the caller has it
    (a :class:`DecodeBatch` keeps it); the tables are then written as one matrix.
    """
    B = len(context_lens)
    if padded is None and len(page_tables) == B >= PACK_MATRIX_MIN:
        padded = padded_tables(page_tables)
    if padded is None or len(padded[1]) != B:
        return _pack_tables_loop(page_tables, context_lens, chunk_len, stride, seq_chunks)
    mat, lens = padded
    longest = int(lens.max()) if B else 1
    host, offset, stride = _packed_header(B, longest, context_lens, chunk_len, stride, seq_chunks)
    if mat.size and (mat.min() < 0 or mat.max() > _INT32_MAX):  # the zero padding changes neither
        raise IndexError("page index does not fit int32")
    host[offset:].reshape(B, stride)[:, :mat.shape[1]] = mat
    return host, offset, stride


def _packed_header(B: int, longest: int, context_lens: Sequence[int], chunk_len: int, stride: int,
                   seq_chunks: Sequence[int] | None) -> tuple[np.ndarray, int, int]:
    """:func:`pack_tables`' host array with its lengths, chunk words and zeroed tables: ``(host, offset, stride)``."""
    stride = stride or max(1, longest)
    if longest > stride:
        raise ValueError(f"a page table of {longest} pages does not fit the stride {stride}")
    offset = tables_offset(B)
    host = np.zeros(offset + B * stride, np.int32)
    host[:B] = np.asarray(context_lens, np.int64)
    host[B] = chunk_len
    if seq_chunks is not None:
        if len(seq_chunks) != B:
            raise ValueError(f"{len(seq_chunks)} chunk lengths for {B} sequences")
        host[B + 1:2 * B + 1] = np.asarray(seq_chunks, np.int64)
    return host, offset, stride


def _pack_tables_loop(page_tables: Sequence[np.ndarray], context_lens: Sequence[int], chunk_len: int,
                      stride: int, seq_chunks: Sequence[int] | None) -> tuple[np.ndarray, int, int]:
    """:func:`pack_tables` one table at a time (tables :func:`padded_tables` does not take)."""
    B = len(context_lens)
    longest = max((len(t) for t in page_tables), default=1)
    host, offset, stride = _packed_header(B, longest, context_lens, chunk_len, stride, seq_chunks)
    for b, t in enumerate(page_tables):
        t = np.asarray(t, np.int64)
        if t.size and (t.min() < 0 or t.max() > _INT32_MAX):
            raise IndexError("page index does not fit int32")
        host[offset + b * stride:offset + b * stride + len(t)] = t
    return host, offset, stride


class CudaDecodeAttention:
    """Decode-attention kernels of one device, in the shape the dispatcher takes.

    ``optin``: set ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` for both kernel families on this
    device (every variant, as it is loaded, before its first launch); ``limits.optin_set`` then names
    them. ``prepare``: ``(dtype, head_dim, group)`` variants to compile and load now rather than on first use.
    """

    def __init__(self, device: CudaDevice, optin: bool = True, workspace_bytes: int = 64 << 20,
                 prepare: Iterable[tuple[str, int, int]] = ()) -> None:
        self.device = device
        self.workspace_bytes = int(workspace_bytes)
        self.workspace = device.alloc(self.workspace_bytes)
        # The families this backend opts in on this device. Policy: every variant's kernel gets the
        # attribute when it is loaded, before its first launch (optin_record() shows each kernel's truth,
        # and Kernel.launch re-checks it, so a kernel that somehow lacks it is rejected, never launched).
        self._optin_families: frozenset[str] = frozenset({SINGLE, MULTI}) if optin else frozenset()
        self._staging: DeviceBuffer | None = None
        self._variants: dict[Variant, dict[str, Kernel]] = {}
        for cfg in prepare:
            self.kernels_for(choose_variant(*cfg))

    @property
    def limits(self) -> DeviceLimits:
        """The device's queried limits plus ``optin_set`` = the families opted in on this device."""
        return self.device.limits.with_optin(*sorted(self._optin_families))

    def optin_record(self) -> dict[str, int | None]:
        """Per loaded kernel (``variant/entry``): the opt-in bytes set on this device, None if never set."""
        return {f"{v.impl}-{v.dtype}-hd{v.head_dim}-nt{v.ntiles}/{k.name}": k.optin_bytes(self.device)
                for v, ks in self._variants.items() for k in ks.values()}

    def kernels_for(self, variant: Variant) -> dict[str, Kernel]:
        ks = self._variants.get(variant)
        if ks is None:
            m = load_module(SOURCE, variant.options, self.device.arch)
            ks = {SINGLE: m.kernel(ENTRY[SINGLE]), MULTI: m.kernel(ENTRY[MULTI]),
                  **{e: m.kernel(e) for e in REDUCE_ENTRY.values()}}
            for fam in self._optin_families:
                if ks[fam].optin_bytes(self.device) is None:
                    ks[fam].set_max_dynamic_smem(self.device)
            self._variants[variant] = ks
        return ks

    def kernels(self) -> dict[str, Any]:
        return {SINGLE: self.run_plan, MULTI: self.run_plan}

    def dispatcher(self, mode: Mode = "auto") -> DecodeAttentionDispatcher:
        """A dispatcher bound to this device: its limits, its workspace, its kernels."""
        return DecodeAttentionDispatcher(mode, self.limits, self.workspace_bytes, self.kernels())

    # ------------------------------------------------------------------ launching

    def _check(self, q: DeviceArray, k_buf: DeviceArray, v_buf: DeviceArray) -> None:
        for name, a in (("q", q), ("k_buf", k_buf), ("v_buf", v_buf)):
            if not isinstance(a, DeviceArray):
                raise TypeError(f"{name} must be a DeviceArray, got {type(a).__name__}")
            if a.device != self.device.ordinal:
                raise ValueError(f"{name} is on device {a.device}, this backend serves {self.device.ordinal}")
        if q.dtype != k_buf.dtype or v_buf.dtype != k_buf.dtype:
            raise ValueError(f"q/k/v dtypes differ: {q.dtype}, {k_buf.dtype}, {v_buf.dtype}")

    def upload_tables(self, page_tables: Sequence[np.ndarray], context_lens: Sequence[int],
                      seq_chunks: Sequence[int] | None = None) -> tuple[int, int, int]:
        """Lengths (and per-sequence chunk lengths) and page tables as int32 on the device: ``(lens_ptr,
        tables_ptr, table_stride)``."""
        host, offset, stride = pack_tables(page_tables, context_lens, seq_chunks=seq_chunks)
        if self._staging is None or self._staging.nbytes < host.nbytes:
            if self._staging is not None:
                self._staging.free()  # stream-ordered: after the launches that still read it
            self._staging = self.device.alloc(max(host.nbytes, 1 << 16), stream_ordered=True)
        self.device.copy_htod(self._staging.ptr, host)
        return self._staging.ptr, self._staging.ptr + 4 * offset, stride

    def run_plan(self, p: LaunchPlan, q: DeviceArray, k_buf: DeviceArray, v_buf: DeviceArray,
                 page_tables: Sequence[np.ndarray], context_lens: Sequence[int]) -> DeviceArray:
        """The dispatcher's kernel: launch plan ``p`` as validated. Returns float32 ``[B, Hq, hd]``."""
        self._check(q, k_buf, v_buf)
        lens_ptr, tables_ptr, stride = self.upload_tables(page_tables, context_lens, p.seq_chunks)
        out = self.device.empty(q.shape, "float32", stream_ordered=True)
        self.launch(p, q, k_buf, v_buf, tables_ptr, stride, lens_ptr, out)
        return out

    def launch(self, p: LaunchPlan, q: DeviceArray, k_buf: DeviceArray, v_buf: DeviceArray, tables_ptr: int,
               table_stride: int, lens_ptr: int, out: DeviceArray, device_chunk: bool = False) -> None:
        """Launch plan ``p`` on tables already on the device (the benchmark's and the ``cuda`` backend's path;
        no host work but the argument packing). ``device_chunk``: the kernels read the chunk length from
        ``lens[B]`` (a graph's launches stay valid while the contexts grow)."""
        B, Hq, hd = q.shape
        if k_buf.size // hd >= 2**31:
            raise ValueError(f"KV pool of {k_buf.size // hd} rows: the kernels index rows with 32 bits")
        variant = choose_variant(k_buf.dtype.name, hd, Hq // k_buf.shape[2], p.block_threads)
        ks = self.kernels_for(variant)
        for launch in attention_launches(p, batch=B, num_q_heads=Hq, num_kv_heads=k_buf.shape[2], head_dim=hd,
                                         page_size=k_buf.shape[1], q=q.ptr, k=k_buf.ptr, v=v_buf.ptr,
                                         tables=tables_ptr, table_stride=table_stride, lens=lens_ptr, out=out.ptr,
                                         workspace=self.workspace.ptr, device_chunk=device_chunk):
            ks[FAMILY[launch.kernel]].run(self.device, launch)
