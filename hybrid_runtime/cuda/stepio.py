"""The one upload and the one download of a device step: fixed layouts of the step's small inputs and of
the sampler's outputs (no driver calls here, so the layouts and the packing are tested on any machine).

A step sends, in ONE host-to-device copy from pinned memory, everything the kernels read that changes
from step to step: token ids, positions, the KV pool row of every new token, the sequences' token offsets
and state slots, the rows that need logits, the sampling parameters, and the attention lengths / chunk
length / page tables (:func:`~hybrid_runtime.cuda.attention.pack_tables` layout). It receives, in ONE
device-to-host copy, the sampled token ids, their logprobs and the top-N logprobs. The offsets of every
field are fixed at load, so a captured CUDA graph reads the same addresses on every replay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .attention import pack_tables, tables_offset

ROW_WORDS = 8  # int32 sampling parameters per row (ops/cuda/sampling.cu)
MAX_TOP_LOGPROBS = 20
_ALIGN = 256


def _up(n: int, a: int = _ALIGN) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class InputLayout:
    """Byte offsets of the step-input region. ``max_tokens``: tokens of the largest step (prefill chunk or
    decode bucket); ``max_rows``: sequences / logit rows; ``table_stride``: ints per page-table row."""

    max_tokens: int
    max_rows: int
    table_stride: int

    @cached_property
    def ids(self) -> int:
        return 0

    @cached_property
    def positions(self) -> int:
        return _up(4 * self.max_tokens)

    @cached_property
    def kv_rows(self) -> int:
        return self.positions + _up(4 * self.max_tokens)

    @cached_property
    def seq_start(self) -> int:
        return self.kv_rows + _up(8 * self.max_tokens)

    @cached_property
    def slots(self) -> int:
        return self.seq_start + _up(4 * (self.max_rows + 1))

    @cached_property
    def logit_rows(self) -> int:
        return self.slots + _up(4 * self.max_rows)

    @cached_property
    def sample_params(self) -> int:
        return self.logit_rows + _up(4 * self.max_rows)

    @cached_property
    def attn(self) -> int:
        """Attention lengths, the chunk word and page tables (pack_tables), one row per query."""
        return self.sample_params + _up(4 * ROW_WORDS * self.max_rows)

    def attn_ints(self, queries: int) -> int:
        return tables_offset(queries) + queries * self.table_stride

    @cached_property
    def nbytes(self) -> int:
        return self.attn + _up(4 * self.attn_ints(self.max_tokens))

    def tables(self, queries: int) -> int:
        """Byte offset of the page tables of a step with ``queries`` attention queries."""
        return self.attn + 4 * tables_offset(queries)


@dataclass(frozen=True)
class OutputLayout:
    """Byte offsets of the sampler's output region (``max_rows`` rows)."""

    max_rows: int

    @property
    def tokens(self) -> int:
        return 0

    @property
    def logprobs(self) -> int:
        return _up(4 * self.max_rows)

    @property
    def top_ids(self) -> int:
        return self.logprobs + _up(4 * self.max_rows)

    @property
    def top_logprobs(self) -> int:
        return self.top_ids + _up(4 * MAX_TOP_LOGPROBS * self.max_rows)

    @property
    def nbytes(self) -> int:
        return self.top_logprobs + _up(4 * MAX_TOP_LOGPROBS * self.max_rows)

    def used(self, rows: int, top: bool) -> int:
        """Bytes to download for ``rows`` rows (``top``: the top-N arrays too)."""
        return self.nbytes if top else self.top_ids

    def unpack(self, buf: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(tokens [rows], logprobs [rows], top ids [rows, 20], top logprobs [rows, 20]) views of ``buf``."""
        b = buf.view(np.uint8)
        tok = b[self.tokens:self.tokens + 4 * rows].view(np.int32)
        lp = b[self.logprobs:self.logprobs + 4 * rows].view(np.float32)
        ti = b[self.top_ids:self.top_ids + 4 * MAX_TOP_LOGPROBS * rows].view(np.int32).reshape(rows, -1)
        tl = b[self.top_logprobs:self.top_logprobs + 4 * MAX_TOP_LOGPROBS * rows].view(np.float32).reshape(rows, -1)
        return tok, lp, ti, tl


@dataclass
class StepInputs:
    """One step's inputs, ready to pack. Every array is validated by the caller (the backend's prepare)."""

    ids: np.ndarray  # [T] int
    positions: np.ndarray  # [T] int
    kv_rows: np.ndarray  # [T] int64 pool rows (page * page_size + offset)
    seq_start: np.ndarray  # [S + 1] int
    slots: np.ndarray  # [S] int
    logit_rows: np.ndarray  # [R] int (token rows whose logits are needed)
    sample_params: np.ndarray  # [R, ROW_WORDS] int32
    attn_lens: Sequence[int]  # [Q] per attention query (decode: one per sequence)
    attn_tables: Sequence[np.ndarray]  # [Q] page tables
    chunk_len: int  # the attention plan's chunk (read by the kernels from after the lengths)
    # prefill attention kernel: its work list + per-sequence page tables (pack_prefill_inputs), written at
    # ``attn`` instead of the per-query lengths and tables
    attn_packed: np.ndarray | None = None
    seq_chunks: Sequence[int] | None = None  # [Q] the batch-invariant split's per-sequence chunk lengths
    # padded_tables(attn_tables) when the caller has it (the step's DecodeBatch keeps it): packed as one matrix
    attn_padded: tuple[np.ndarray, np.ndarray] | None = None


def pack(layout: InputLayout, host: np.ndarray, s: StepInputs) -> int:
    """Write ``s`` into the pinned host mirror ``host`` (uint8, ``layout.nbytes``); returns the number of
    leading bytes to upload (everything up to the end of the used page tables)."""
    T, S, R, Q = len(s.ids), len(s.slots), len(s.logit_rows), len(s.attn_lens)
    if layout.max_tokens < T or layout.max_rows < S or layout.max_rows < R or layout.max_tokens < Q:
        raise ValueError(f"step of {T} tokens / {S} sequences / {R} logit rows / {Q} queries exceeds the layout "
                         f"({layout.max_tokens} tokens, {layout.max_rows} rows)")
    b = host.view(np.uint8)[:layout.nbytes]  # every offset is a multiple of 256 bytes: typed views line up
    i32, i64 = b.view(np.int32), b.view(np.int64)

    def put(off: int, arr: np.ndarray) -> None:  # the int32 words of arr (cast as astype casts)
        a = arr if type(arr) is np.ndarray and arr.ndim == 1 else np.asarray(arr).reshape(-1)
        i32[off // 4:off // 4 + a.size] = a

    put(layout.ids, s.ids)
    put(layout.positions, s.positions)
    kv = s.kv_rows if type(s.kv_rows) is np.ndarray and s.kv_rows.ndim == 1 else np.asarray(s.kv_rows).reshape(-1)
    i64[layout.kv_rows // 8:layout.kv_rows // 8 + kv.size] = kv
    put(layout.seq_start, s.seq_start)
    put(layout.slots, s.slots)
    put(layout.logit_rows, s.logit_rows)
    put(layout.sample_params, s.sample_params)
    if s.attn_packed is not None:
        attn = np.ascontiguousarray(s.attn_packed, np.int32)
    else:
        attn, _, _ = pack_tables(s.attn_tables, s.attn_lens, chunk_len=s.chunk_len, stride=layout.table_stride,
                                 seq_chunks=s.seq_chunks, padded=s.attn_padded)
    if attn.size > layout.attn_ints(layout.max_tokens):
        raise ValueError(f"attention inputs of {attn.size} ints exceed the layout's "
                         f"{layout.attn_ints(layout.max_tokens)}")
    put(layout.attn, attn)
    return layout.attn + attn.nbytes
