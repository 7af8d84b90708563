"""The whole-batch (numpy) helpers of ``CudaBackend.prepare`` give exactly what the per-sequence loops they replace
gave: the same arrays, plans and reason tuples, the same exceptions with the same messages (issue 15: a decode
step's host time). Each ``_old_*`` below is the code as it was before the change, kept here as the reference."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from hybrid_runtime.backend import SampleRow, slot_mapping
from hybrid_runtime.cuda import sampler as sampler_mod
from hybrid_runtime.cuda.attention import PACK_MATRIX_MIN, pack_tables, tables_offset
from hybrid_runtime.cuda.sampler import row_params, rows_params
from hybrid_runtime.cuda.stepio import ROW_WORDS, InputLayout, StepInputs, pack
from hybrid_runtime.ops.base import SeqStep
from hybrid_runtime.ops.dispatcher import (
    MULTI,
    SINGLE,
    VECTOR_MIN,
    DecodeBatch,
    DeviceLimits,
    LaunchPlan,
    _chunks_short,
    padded_tables,
    sequence_chunk,
    sequence_chunks,
    sequence_plan,
    validate,
)
from hybrid_runtime.ops.gdn import _check_slots
from hybrid_runtime.sampling import SamplingParams

H200 = DeviceLimits("sim-h200", sm_count=132, optin_set=frozenset({SINGLE, MULTI}))
LIMITS = [H200, DeviceLimits.cpu(), DeviceLimits("odd", sm_count=7, min_chunk_tokens=48),
          DeviceLimits("zero", sm_count=7, min_chunk_tokens=0)]


def outcome(fn: Any, *args: Any, **kw: Any) -> Any:
    """fn's result, or (exception type, message) when it raises."""
    try:
        return ("ok", fn(*args, **kw))
    except Exception as e:  # the exception is the outcome compared
        return ("raised", type(e).__name__, str(e))


def same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype \
            and np.array_equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# ---------------------------------------------------------------- the code before the change (reference)

def _old_slot_mapping(steps: list[SeqStep], positions: np.ndarray, bounds: np.ndarray, page_size: int,
                      num_pages: int) -> tuple[np.ndarray, np.ndarray]:
    pages = np.empty(len(positions), np.int64)
    for i, s in enumerate(steps):
        a, b = int(bounds[i]), int(bounds[i + 1])
        need = -(-(s.start_pos + b - a) // page_size)
        if need > len(s.page_table):
            raise IndexError(f"page table of {len(s.page_table)} pages does not cover {s.start_pos + b - a} tokens")
        if a == b:
            continue
        first, last = int(positions[a]) // page_size, int(positions[b - 1]) // page_size
        pages[a:b] = np.asarray(s.page_table[first:last + 1], np.int64)[positions[a:b] // page_size - first]
    if len(pages) and (pages.min() < 0 or pages.max() >= num_pages):
        raise IndexError(f"page index outside the pool of {num_pages} pages")
    return pages, positions % page_size


def _old_check_slots(slots: np.ndarray, rows: int, n: int) -> np.ndarray:
    s = np.asarray(slots)
    if s.shape != (n,) or not np.issubdtype(s.dtype, np.integer):
        raise ValueError(f"slots must be an integer array of shape ({n},), got {s.dtype} {s.shape}")
    bad = (s < 0) | (s >= rows)
    if bad.any():
        raise IndexError(f"state slot(s) {s[bad].tolist()} out of range: buffers have rows 0..{rows - 1} "
                         f"(row {rows - 1} is the padding sink)")
    live = s[s != rows - 1]
    if np.unique(live).size != live.size:
        raise ValueError(f"live slots must be distinct, got {s.tolist()}")
    return s.astype(np.intp)


def _old_pack_tables(page_tables: Any, context_lens: Any, chunk_len: int = 0, stride: int = 0,
                     seq_chunks: Any = None) -> tuple[np.ndarray, int, int]:
    B = len(context_lens)
    longest = max((len(t) for t in page_tables), default=1)
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
    for b, t in enumerate(page_tables):
        t = np.asarray(t, np.int64)
        if t.size and (t.min() < 0 or t.max() > np.iinfo(np.int32).max):
            raise IndexError("page index does not fit int32")
        host[offset + b * stride:offset + b * stride + len(t)] = t
    return host, offset, stride


def _old_problems(b: DecodeBatch) -> tuple[str, ...]:
    r = []
    if b.beam_width != 1:
        r.append("beam_width")
    if b.dtype not in ("float32", "float16", "bfloat16"):
        r.append("dtype")
    if not (16 <= b.head_dim <= 256 and b.head_dim % 16 == 0):
        r.append("head_dim")
    if b.num_kv_heads < 1 or b.num_q_heads % b.num_kv_heads:
        r.append("gqa")
    if any(n < 1 for n in b.context_lens):
        r.append("context_len")
    for n, table in zip(b.context_lens, b.page_tables):
        used = table[:-(-max(n, 0) // b.page_size)]
        if len(used) * b.page_size < n:
            r.append("page_table")
        if used.size and (used.min() < 0 or used.max() >= b.num_pool_pages):
            r.append("page_index")
    return tuple(dict.fromkeys(r))


def _old_sequence_plan(batch: DecodeBatch, limits: DeviceLimits, blocks: int = 0) -> LaunchPlan:
    from hybrid_runtime.ops.dispatcher import (
        BLOCK_THREADS,
        DTYPE_BYTES,
        KV_TILES,
        REDUCE_DIMS_PER_CTA,
        SEQ_CHUNKS,
        partials_bytes_per_block,
        reduce_threads,
        smem_bytes,
    )
    lens = batch.context_lens
    chunks = tuple(sequence_chunk(n, limits) for n in lens)
    need = max([2, *(-(-max(n, 1) // c) for n, c in zip(lens, chunks))])
    blocks = max(int(blocks), 0) or need
    B, hq, hd = batch.batch_size, batch.num_q_heads, batch.head_dim
    es = DTYPE_BYTES.get(batch.dtype, 4)
    cap = limits.max_shared_mem_optin if MULTI in limits.optin_set else limits.max_shared_mem_per_block
    tile = next((t for t in KV_TILES if smem_bytes(batch.group, hd, es, t) <= cap), KV_TILES[-1])
    return LaunchPlan(MULTI, blocks, (blocks, batch.num_kv_heads, B), BLOCK_THREADS,
                      smem_bytes(batch.group, hd, es, tile), tile, max(chunks, default=1),
                      partials_bytes_per_block(batch) * blocks, (B, hq, -(-hd // REDUCE_DIMS_PER_CTA)),
                      reduce_threads(SEQ_CHUNKS), chunks)


def _old_rows(rows: list[SampleRow] | None, R: int) -> np.ndarray:
    params = np.zeros((R, ROW_WORDS), np.int32)
    params[:, 0] = 1
    params[:, 7] = -1
    for r, sr in enumerate(rows or ()):
        params[r] = row_params(sr.params, sr.seed, sr.counter, sr.logprobs)
    return params


# ---------------------------------------------------------------- random inputs

def _sizes(rng: np.random.Generator) -> int:
    """Batch sizes on both sides of VECTOR_MIN and PACK_MATRIX_MIN (and 0 now and then)."""
    return int(rng.choice([0, 1, 2, 3, PACK_MATRIX_MIN - 1, PACK_MATRIX_MIN, 8, VECTOR_MIN - 1, VECTOR_MIN,
                           VECTOR_MIN + 1, 33, 64]))


def _table(rng: np.random.Generator, n: int, pool: int) -> Any:
    t = rng.integers(0, pool, n)
    kind = int(rng.integers(0, 4))
    return [int(x) for x in t] if kind == 0 else t.astype([np.int64, np.int32, np.uint32, np.int64][kind])


def _steps(rng: np.random.Generator, B: int, decode: bool, ps: int, pool: int) -> tuple[list, np.ndarray, np.ndarray]:
    steps, pos, lens = [], [], []
    for b in range(B):
        k = 1 if decode else int(rng.choice([0, 1, 2, 17, 40]))
        start = int(rng.integers(0, 400))
        need = -(-(start + k) // ps)
        table = _table(rng, need + int(rng.integers(0, 3)), pool)
        steps.append(SeqStep(b, table, start, [1] * k))
        pos.append(np.arange(start, start + k))
        lens.append(k)
    bounds = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64) if B else np.zeros(1, np.int64)
    positions = np.concatenate(pos) if pos else np.zeros(0, np.int64)
    return steps, positions.astype(np.int64), bounds


def _break(rng: np.random.Generator, steps: list, ps: int, pool: int) -> None:
    """One error (or a harmless oddity) in a random sequence: a short table, a page out of the pool (touched or
    not), a junk page past the used ones."""
    if not steps:
        return
    s = steps[int(rng.integers(0, len(steps)))]
    t = [int(x) for x in s.page_table]
    kind = int(rng.integers(0, 4))
    if kind == 0 and t:
        t = t[:max(0, -(-(s.start_pos + len(s.token_ids)) // ps) - 1)]
    elif kind == 1 and t:
        t[int(rng.integers(0, len(t)))] = int(rng.choice([-1, pool, pool + 7]))
    elif kind == 2 and t:
        t[-1] = -3
    else:
        t = [*t, pool + 1]
    s.page_table = t if rng.random() < 0.5 else np.asarray(t, np.int64)


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("seed", range(6))
def test_slot_mapping_matches_the_loop(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(150):
        ps, pool = int(rng.choice([1, 16, 64])), 300
        decode = rng.random() < 0.6
        steps, positions, bounds = _steps(rng, _sizes(rng), decode, ps, pool)
        if rng.random() < 0.4:
            _break(rng, steps, ps, pool)
        got = outcome(slot_mapping, steps, positions, bounds, ps, pool)
        want = outcome(_old_slot_mapping, steps, positions, bounds, ps, pool)
        assert same(got, want), (got, want)


@pytest.mark.parametrize("seed", range(4))
def test_check_slots_matches_the_loop(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(300):
        n, rows = int(rng.integers(0, 70)), int(rng.integers(1, 80))
        s = rng.integers(0, rows, n)
        if rng.random() < 0.5:  # mostly distinct live slots, the sink repeated
            s = np.where(rng.random(n) < 0.3, rows - 1, rng.permutation(max(rows, n))[:n] % rows)
        if n and rng.random() < 0.3:
            s[int(rng.integers(0, n))] = int(rng.choice([-1, rows, rows + 5]))
        s = s.astype([np.int64, np.int32, np.uint32][int(rng.integers(0, 3))]) if (s >= 0).all() else s.astype(np.int64)
        args = [s, rows, n if rng.random() < 0.9 else n + 1]
        if rng.random() < 0.05:
            args[0] = s.astype(np.float64)
        got, want = outcome(_check_slots, *args), outcome(_old_check_slots, *args)
        assert same(got, want), (got, want)


@pytest.mark.parametrize("seed", range(4))
def test_rows_params_matches_row_params(seed: int) -> None:
    rng = np.random.default_rng(seed)
    shared = [SamplingParams(temperature=float(t), top_k=int(k), top_p=float(p))
              for t, k, p in [(0.0, 0, 1.0), (0.7, 50, 0.9), (1.3, 1, 0.37), (1e-3, 0, 1e-4), (100.0, 2**40, 1.0)]]
    for _ in range(200):
        B = _sizes(rng)
        rows = []
        for _b in range(B):
            p = shared[int(rng.integers(0, len(shared)))] if rng.random() < 0.5 else SamplingParams(
                temperature=float(rng.choice([0.0, 0.5, 0.7, 1.0, 2.5])), top_k=int(rng.choice([0, 1, 5, 40])),
                top_p=float(rng.choice([1.0, 0.95, 0.5, 0.123456789])))
            seed_ = int(rng.choice([0, 1, 2**32 - 1, 2**32, 2**32 + 5, 2**63 - 1, 2**64 - 1, 2**70 + 3, -1,
                                    int(rng.integers(0, 2**62))]))
            lp = rng.choice([None, 0, 1, 5, 20, 21, 1000, -1, -(2**40), -(2**70)])
            rows.append(SampleRow(p, seed=seed_, counter=int(rng.choice([0, 1023, 2**32 + 9, -2])),
                                  logprobs=None if lp is None else int(lp)))
        R = B + int(rng.integers(0, 3))
        got, want = outcome(rows_params, rows, R), outcome(_old_rows, rows, R)
        assert same(got, want), (got, want)


def test_rows_params_remembers_only_frozen_params() -> None:
    """A duck-typed params object may change between steps: its words are recomputed, never cached."""
    p = SimpleNamespace(greedy=False, top_k=3, temperature=0.5, top_p=0.9)
    row = SimpleNamespace(params=p, seed=7, counter=1, logprobs=None)
    first = rows_params([row], 1)
    p.top_k, p.temperature = 9, 1.5
    second = rows_params([row], 1)
    assert not np.array_equal(first, second)
    assert np.array_equal(second[0], row_params(p, 7, 1))
    frozen = SamplingParams(temperature=0.5)
    rows_params([SampleRow(frozen)], 1)
    assert sampler_mod._STATIC[id(frozen)][0] is frozen


@pytest.mark.parametrize("seed", range(4))
def test_pack_tables_matches_the_loop(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(250):
        B = _sizes(rng)
        tables = [_table(rng, int(rng.integers(0, 12)), 1000) for _ in range(B)]
        if B and rng.random() < 0.2:
            t = [int(x) for x in tables[0]] + [int(rng.choice([-1, 2**31, 2**31 - 1]))]
            tables[int(rng.integers(0, B))] = t if rng.random() < 0.5 else np.asarray(t, np.int64)
        lens = [int(x) for x in rng.integers(1, 5000, B)]
        kw: dict[str, Any] = dict(chunk_len=int(rng.integers(0, 300)), stride=int(rng.choice([0, 0, 12, 14, 5])))
        if rng.random() < 0.5:
            kw["seq_chunks"] = [int(x) for x in rng.integers(1, 200, B + int(rng.random() < 0.1))]
        got, want = outcome(pack_tables, tables, lens, **kw), outcome(_old_pack_tables, tables, lens, **kw)
        assert same(got, want), (got, want)
        pt = padded_tables([np.asarray(t, np.int64) for t in tables])
        if pt is not None:  # the matrix a DecodeBatch keeps gives the same bytes
            assert same(outcome(pack_tables, tables, lens, padded=pt, **kw), want)


def test_padded_tables_refuses_what_it_cannot_hold_exactly() -> None:
    assert padded_tables([np.array([1, 2], np.uint64)]) is None
    assert padded_tables([[1.5, 2.0]]) is None
    assert padded_tables([np.zeros((2, 2), np.int64)]) is None
    assert padded_tables([[3], []]) is None  # an empty list is float64 to numpy: the loop takes it
    mat, lens = padded_tables([[3, 4, 5], np.array([7], np.int32), np.zeros(0, np.int64)])  # type: ignore[misc]
    assert mat.tolist() == [[3, 4, 5], [7, 0, 0], [0, 0, 0]] and lens.tolist() == [3, 1, 0]


def _batch(rng: np.random.Generator, B: int, ps: int, pool: int) -> DecodeBatch:
    lens, tables = [], []
    for _ in range(B):
        n = int(rng.choice([1, 2, 63, 64, 65, 1000, 4097, int(rng.integers(1, 40000))]))
        if rng.random() < 0.05:
            n = int(rng.choice([0, -3]))
        t = rng.integers(0, pool, -(-max(n, 1) // ps) + int(rng.integers(0, 3)))
        r = rng.random()
        if r < 0.1:
            t = t[:max(0, len(t) - 3)]  # too short
        elif r < 0.2 and len(t):
            t[int(rng.integers(0, len(t)))] = int(rng.choice([-1, pool, pool + 9]))  # maybe past the used pages
        lens.append(n)
        tables.append(t.astype(np.int64))
    return DecodeBatch(tuple(lens), tuple(tables), 16, 2, 256, ps, "bfloat16", pool)


@pytest.mark.parametrize("seed", range(4))
def test_problems_sequence_plan_and_validate_match_the_loops(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(120):
        b = _batch(rng, _sizes(rng), int(rng.choice([16, 64])), 5000)
        assert b.problems == _old_problems(b)
        for lim in LIMITS:
            blocks = int(rng.choice([0, 0, 1, 2, 4, 64, 128]))
            got, want = outcome(sequence_plan, b, lim, blocks), outcome(_old_sequence_plan, b, lim, blocks)
            assert same(got, want), (got, want)
            if got[0] == "ok":
                p = got[1]
                assert sequence_plan(b, lim, blocks) is p  # once per (batch, limits, blocks)
                assert validate(p, b, lim, 1 << 30) == validate(p, b, lim, 1 << 30)
                # the per-sequence chunk check, on honest and on tampered chunk lists
                for chunks in (p.seq_chunks, tuple(c - 1 for c in p.seq_chunks), tuple(c // 3 for c in p.seq_chunks),
                               tuple(2**40 for _ in p.seq_chunks)):
                    q = replace(p, seq_chunks=chunks)
                    want_short = any(c < 1 or q.blocks_per_seq * c < n for n, c in zip(b.context_lens, chunks))
                    assert _chunks_short(q, b) == want_short
                    assert ("plan_inconsistent" in validate(q, b, lim, 1 << 30)) >= want_short


def test_problems_report_reasons_in_first_seen_order() -> None:
    """The order of "page_table" and "page_index" follows the first sequence that has either, as the loop's."""
    ok = np.arange(4, dtype=np.int64)
    short, bad = np.arange(1, dtype=np.int64), np.array([0, 1, 9999, 3], np.int64)
    k = VECTOR_MIN
    for tables, want in (([ok] * k + [short, bad], ("page_table", "page_index")),
                         ([ok] * k + [bad, short], ("page_index", "page_table")),
                         ([ok] * k + [np.array([-1], np.int64)], ("page_table", "page_index"))):
        b = DecodeBatch((64,) * len(tables), tuple(tables), 16, 2, 256, 16, "bfloat16", 100)
        assert len(tables) >= VECTOR_MIN and b.problems == want == _old_problems(b)


def test_sequence_chunks_is_sequence_chunk_of_each() -> None:
    lens = np.array([-5, 0, 1, 63, 64, 65, 4095, 4096, 4097, 10**6, 2**40], np.int64)
    for lim in LIMITS:
        assert sequence_chunks(lens, lim).tolist() == [sequence_chunk(int(n), lim) for n in lens]


def test_pack_writes_the_fields_through_typed_views_as_before() -> None:
    """pack's bytes: every field as the int32 (kv rows int64) words of its array, at the layout's offsets, the
    rest of the mirror untouched."""
    layout = InputLayout(16, 8, 4)
    rng = np.random.default_rng(0)
    host = rng.integers(0, 256, layout.nbytes).astype(np.uint8)
    before = host.copy()
    s = StepInputs(np.array([5, 2**31 + 3], np.int64), np.array([7, 8]), np.array([2**40, 3], np.int64),
                   np.array([0, 1, 2]), np.array([4, 1]), np.array([0, 1]),
                   rng.integers(-2**31, 2**31, (2, ROW_WORDS)).astype(np.int32), [9, 17], [[1, 2], [3]], 64)
    up = pack(layout, host, s)
    b = host.view(np.uint8)
    assert b[layout.ids:layout.ids + 8].view(np.int32).tolist() == [5, np.int64(2**31 + 3).astype(np.int32)]
    assert b[layout.kv_rows:layout.kv_rows + 16].view(np.int64).tolist() == [2**40, 3]
    assert np.array_equal(b[layout.sample_params:layout.sample_params + 64].view(np.int32).reshape(2, -1),
                          s.sample_params)
    attn, _, _ = _old_pack_tables([[1, 2], [3]], [9, 17], 64, layout.table_stride)
    assert np.array_equal(b[layout.attn:up].view(np.int32), attn)
    assert np.array_equal(b[up:], before[up:])  # nothing past the upload
    gap = layout.positions + 8
    assert np.array_equal(b[gap:layout.kv_rows], before[gap:layout.kv_rows])  # alignment gaps keep their bytes
