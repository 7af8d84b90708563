"""The ``cuda`` backend's host side, on any machine: graph buckets and plan classes, the guard on class plans,
the one-upload / one-download layouts, the sampler's parameters and its numpy twin, and NVRTC compiles of the
new kernels (no spills)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from hybrid_runtime.cuda.graphs import GraphStats, bucket_for, choose, class_blocks, decode_buckets
from hybrid_runtime.cuda.sampler import philox_uniform, reference_sample, row_params
from hybrid_runtime.cuda.stepio import MAX_TOP_LOGPROBS, InputLayout, OutputLayout, StepInputs, pack
from hybrid_runtime.ops.dispatcher import (
    MULTI,
    SINGLE,
    DecodeAttentionDispatcher,
    DecodeBatch,
    DeviceLimits,
    fixed_grid_plan,
    graph_blocks,
    validate,
)
from hybrid_runtime.sampling import SamplingParams

H200 = DeviceLimits("sim-h200", sm_count=132, optin_set=frozenset({SINGLE, MULTI}))


def batch(lens: list[int], hq: int = 16, hkv: int = 2, hd: int = 256, ps: int = 16, pages: int = 10_000
          ) -> DecodeBatch:
    return DecodeBatch(tuple(lens), tuple(np.arange(-(-n // ps)) for n in lens), hq, hkv, hd, ps, "bfloat16", pages)


def test_buckets() -> None:
    assert decode_buckets(1) == [1]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert [bucket_for(n, [1, 2, 4, 6]) for n in (1, 2, 3, 5, 6, 7)] == [1, 2, 4, 6, 6, None]
    with pytest.raises(ValueError):
        decode_buckets(0)


def test_graph_plan_classes_cover_every_context_with_a_fixed_grid() -> None:
    d = DecodeAttentionDispatcher("auto", H200, 64 << 20)
    assert [graph_blocks(b) for b in (1, 2, 3, 4, 7, 64, 100, 128)] == [1, 2, 2, 4, 4, 64, 64, 128]
    classes = class_blocks(d, batch([32768]))
    assert classes[0] == 1 and all(b == 2 ** i for i, b in enumerate(classes)) and classes[-1] >= 64
    assert class_blocks(DecodeAttentionDispatcher("off", H200, 64 << 20), batch([32768])) == [1]
    rng = np.random.default_rng(0)
    for _ in range(300):
        B = int(rng.choice([1, 2, 8, 16, 64]))
        lens = rng.integers(1, 32768, B).tolist()
        bt = batch(lens)
        p = d.select(bt)
        blocks = graph_blocks(p.blocks_per_seq)
        gp = fixed_grid_plan(bt, blocks, d.limits)
        assert validate(gp, bt, d.limits, d.workspace_capacity) == []
        assert gp.blocks_per_seq == blocks and gp.grid == (blocks, 2, B)
        assert gp.chunk_len * blocks >= max(lens)  # every token covered
        assert blocks == 1 or gp.chunk_len % 64 == 0
        # the same class at a longer context keeps every launch argument but the chunk length
        longer = fixed_grid_plan(batch([min(32767, max(lens) + 500)] * B), blocks, d.limits)
        same = ("kernel", "blocks_per_seq", "grid", "block_threads", "smem_bytes", "kv_tile", "reduce_grid",
                "reduce_threads")
        assert all(getattr(longer, f) == getattr(gp, f) for f in same)


def test_the_captured_classes_cover_every_context() -> None:
    """Whatever the contexts (up to max_seq_len), a decode step's class is one a graph was captured for (chunk
    alignment can give a shorter context more chunks than the longest: 1024 -> 8, 1088 -> 6 on this device)."""
    limits = DeviceLimits("sim-h200", sm_count=132, max_shared_mem_optin=227 * 1024,
                          optin_set=frozenset({SINGLE, MULTI}))
    d = DecodeAttentionDispatcher("auto", limits, 64 << 20)
    rng = np.random.default_rng(3)
    for B, max_len in ((1, 1088), (8, 1088), (8, 32832), (64, 4096), (3, 500)):
        classes = class_blocks(d, batch([max_len] * B))
        for _ in range(200):
            lens = rng.integers(1, max_len + 1, B).tolist()
            c = choose(batch(lens), B, d, lambda k, classes=classes: k[1] in classes, True)
            assert c.key is not None, (B, max_len, lens, classes, c)


def test_choose_replays_only_captured_valid_classes() -> None:
    d = DecodeAttentionDispatcher("auto", H200, 64 << 20)
    bt = batch([5000, 12, 900, 1])
    captured = {(4, 1), (4, 2), (4, 4), (4, 8), (4, 16)}
    c = choose(bt, 4, d, captured.__contains__, True)
    assert c.key is not None and c.key[0] == 4 and c.plan is not None and c.plan.blocks_per_seq == c.key[1]
    assert c.plan.chunk_len * c.key[1] >= 5000
    none = choose(bt, 4, d, lambda k: False, True)
    assert none.key is None and none.reason == "no_graph"
    assert none.plan == c.plan  # an eager step launches what the graph would: the same numbers
    off = choose(bt, 4, d, captured.__contains__, False)
    assert off.key is None and off.reason == "graphs_off"
    # a class plan the guard rejects for this batch (a workspace too small for its chunks) is not replayed
    tiny = DecodeAttentionDispatcher("on", H200, 4 << 10)
    c = choose(batch([5000]), 1, tiny, lambda k: True, True)
    assert c.key == (1, 1) and c.plan is not None and c.plan.kernel == SINGLE
    assert choose(None, 2, d, lambda k: k == (2, 1), True).key == (2, 1)
    s = GraphStats(captured={(4, 2): 900}, replays={(4, 2): 3})
    assert s.snapshot()["captured"] == {"b4x2": 900}


def test_step_inputs_pack_into_fixed_aligned_offsets() -> None:
    L = InputLayout(max_tokens=64, max_rows=8, table_stride=32)
    offs = [L.ids, L.positions, L.kv_rows, L.seq_start, L.slots, L.logit_rows, L.sample_params, L.attn]
    assert offs == sorted(offs) and all(o % 256 == 0 for o in offs) and L.nbytes >= L.attn
    host = np.zeros(L.nbytes, np.uint8)
    tables = [np.array([3, 9]), np.array([4]), np.array([7, 1, 2])]
    s = StepInputs(np.array([5, 6, 7]), np.array([17, 3, 40]), np.array([1000, 2, 33], np.int64), np.arange(4),
                   np.array([2, 0, 8]), np.array([0, 1, 2]), np.arange(24, dtype=np.int32).reshape(3, 8),
                   [18, 4, 41], tables, 64)
    n = pack(L, host, s)
    assert n == L.tables(3) + 4 * 3 * 32  # up to the end of the used tables
    i32 = lambda off, k: host[off:off + 4 * k].view(np.int32)  # noqa: E731
    assert i32(L.ids, 3).tolist() == [5, 6, 7] and i32(L.positions, 3).tolist() == [17, 3, 40]
    assert host[L.kv_rows:L.kv_rows + 24].view(np.int64).tolist() == [1000, 2, 33]
    assert i32(L.attn, 4).tolist() == [18, 4, 41, 64]  # lengths, then the chunk length the kernels read
    assert i32(L.tables(3) + 4 * 64, 3).tolist() == [7, 1, 2]
    assert i32(L.sample_params, 24).tolist() == list(range(24))
    with pytest.raises(ValueError, match="exceeds"):
        pack(L, host, StepInputs(np.zeros(65), np.zeros(65), np.zeros(65), np.arange(2), np.zeros(1),
                                 np.zeros(1), np.zeros((1, 8), np.int32), [1], [np.array([0])], 0))
    O = OutputLayout(8)
    buf = np.zeros(O.nbytes, np.uint8)
    buf[O.tokens:O.tokens + 8].view(np.int32)[:] = [11, 12]
    tok, _, ti, _ = O.unpack(buf, 2)
    assert tok.tolist() == [11, 12] and ti.shape == (2, MAX_TOP_LOGPROBS) and O.used(2, False) == O.top_ids


def test_prefill_attention_inputs_replace_the_per_query_tables_in_the_upload() -> None:
    """A prefill step for the tensor-core prefill-attention kernel uploads its work list and one page table per
    sequence at ``attn`` (16-byte aligned, as the kernel reads work items as int4) instead of one table per
    query token; what does not fit the layout is refused, never truncated."""
    from hybrid_runtime.cuda.prefill_attention import pack_prefill_inputs, plan_prefill
    from hybrid_runtime.ops.dispatcher import DeviceLimits

    L = InputLayout(max_tokens=64, max_rows=8, table_stride=8)
    lim = DeviceLimits("fake-h200", sm_count=132)
    plan = plan_prefill([40, 3], [16, 70], num_q_heads=8, num_kv_heads=2, head_dim=128, dtype="bfloat16",
                        page_size=16, limits=lim)
    tables = [np.array([5, 2, 9, 4]), np.array([1, 0, 3, 6, 7])]
    packed = pack_prefill_inputs(plan, tables, table_stride=L.table_stride)
    host = np.zeros(L.nbytes, np.uint8)
    s = StepInputs(np.zeros(43), np.zeros(43), np.zeros(43, np.int64), np.array([0, 40, 43]), np.array([1, 2]),
                   np.array([39, 42]), np.zeros((2, 8), np.int32), [], tables, 0, attn_packed=packed.host)
    n = pack(L, host, s)
    assert L.attn % 16 == 0 and n == L.attn + packed.host.nbytes
    got = host[L.attn:n].view(np.int32)
    assert got[:plan.n_work * 4].reshape(-1, 4).tolist() == plan.work.tolist()
    t1 = L.attn + 4 * (packed.tables_offset + L.table_stride)
    assert host[t1:t1 + 20].view(np.int32).tolist() == [1, 0, 3, 6, 7]
    with pytest.raises(ValueError, match="exceed"):
        pack(L, host, StepInputs(np.zeros(1), np.zeros(1), np.zeros(1, np.int64), np.arange(2), np.zeros(1),
                                 np.zeros(1), np.zeros((1, 8), np.int32), [], [], 0,
                                 attn_packed=np.zeros(L.attn_ints(64) + 1, np.int32)))


def test_sampler_parameters_and_philox_twin() -> None:
    w = row_params(SamplingParams(temperature=0.5, top_k=7, top_p=0.8, seed=2**40 + 5), seed=2**40 + 5, counter=99,
                   n_logprobs=3)
    assert w.dtype == np.int32 and w[0] == 0 and w[1] == 7 and w[6] == 99 and w[7] == 3
    assert w[2:3].view(np.float32)[0] == np.float32(0.5) and w[3:4].view(np.float32)[0] == np.float32(0.8)
    assert (int(w[4]) & 0xFFFFFFFF) | ((int(w[5]) & 0xFFFFFFFF) << 32) == 2**40 + 5
    assert row_params(SamplingParams(), 0, 0)[0] == 1 and row_params(SamplingParams(top_k=1), 0, 0)[0] == 1
    assert row_params(SamplingParams(), 0, 0, None)[7] == -1
    u = philox_uniform(12345, 7, np.arange(4000))
    assert u.dtype == np.float32 and u.min() > 0 and u.max() < 1 and abs(float(u.mean()) - 0.5) < 0.02
    assert np.array_equal(u, philox_uniform(12345, 7, np.arange(4000)))
    assert not np.array_equal(u, philox_uniform(12345, 8, np.arange(4000)))
    assert not np.array_equal(u, philox_uniform(12346, 7, np.arange(4000)))
    # Philox4x32-10 known-answer test (Random123): counter = key = 0 -> 6627e8d5 e169c58d bc57ac4c 9b00dbd8
    assert _philox_words(0, 0, 0, 0, 0, 0) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


def _philox_words(c0: int, c1: int, c2: int, c3: int, k0: int, k1: int) -> list[int]:
    """The same rounds as sampler.philox_uniform on one counter, returning the raw words."""
    M = 0xFFFFFFFF
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & M, (p0 >> 32) ^ c3 ^ k1, p0 & M
        k0, k1 = (k0 + 0x9E3779B9) & M, (k1 + 0xBB67AE85) & M
    return [c0, c1, c2, c3]


def test_reference_sampler_semantics() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal(500).astype(np.float32) * 2
    top = int(np.argmax(x))
    assert reference_sample(x, row_params(SamplingParams(), 1, 0))[0] == top
    assert reference_sample(x, row_params(SamplingParams(temperature=1.0, top_k=1), 1, 0))[0] == top
    assert reference_sample(x, row_params(SamplingParams(temperature=1.0, top_p=1e-6), 1, 3))[0] == top
    kth = np.sort(x)[::-1][9]
    draws = [reference_sample(x, row_params(SamplingParams(temperature=1.0, top_k=10), 3, c))[0] for c in range(300)]
    assert all(x[t] >= kth for t in draws) and len(set(draws)) > 3
    # temperature sampling follows softmax(x / T): frequencies of a 6-token vocabulary over 4000 counters
    small = np.array([1.0, 0.0, -1.0, 2.0, 0.5, -3.0], np.float32)
    counts = np.bincount([reference_sample(small, row_params(SamplingParams(temperature=0.8), 9, c))[0]
                          for c in range(4000)], minlength=6)
    p = np.exp(small / 0.8) / np.exp(small / 0.8).sum()
    assert np.abs(counts / 4000 - p).max() < 0.03
    tok, lp, top5 = reference_sample(x, row_params(SamplingParams(), 1, 0, 5))
    lse = float(np.log(np.exp(x.astype(np.float64)).sum()))
    assert abs(lp - (x[tok] - lse)) < 1e-5 and [i for i, _ in top5] == list(np.argsort(-x)[:5])


def test_new_kernels_compile_without_spills() -> None:
    try:
        from cuda.bindings import nvrtc

        assert int(nvrtc.nvrtcVersion()[0]) == 0
    except Exception as e:
        pytest.skip(f"NVRTC unavailable: {e}")
    from hybrid_runtime.cuda.kernels import compile_log, source

    for name, opts in [("fused.cu", ("-DDT=0",)), ("fused.cu", ("-DDT=1",)), ("fused.cu", ("-DDT=2",)),
                       ("sampling.cu", ())]:
        log = compile_log(source(name), name, opts, "sm_90")
        regs = [int(m) for m in re.findall(r"Used (\d+) registers", log)]
        assert regs and max(regs) <= 255, log
        entries = re.findall(r"Compiling entry function '(\w+)'", log)
        want = {"gemv", "moe_route", "moe_gate_up", "moe_down", "rmsnorm_rows", "rmsnorm_rows_t", "attn_qkv"} \
            if name == "fused.cu" else {"sample_partials", "sample_finish"}
        assert want <= set(entries), log
        # the MoE expert kernels may keep a 16-byte spill of their unrolled token loop (NVRTC 13.5); nothing more
        spills = [int(m) for m in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
        assert max(spills, default=0) <= 96, log


class _FakeDev:
    """Counts what CudaBackend.execute asks of the device (the copy discipline, without a GPU)."""

    def __init__(self) -> None:
        from collections import Counter

        self.copies: Counter = Counter()
        self.syncs = 0

    def copy_htod(self, dst: int, host: np.ndarray) -> None:
        self.copies["htod"] += 1
        self.last_up = int(np.asarray(host).nbytes)

    def copy_dtoh(self, host_ptr: int, src: int, nbytes: int) -> None:
        self.copies["dtoh"] += 1

    def synchronize(self) -> None:
        self.syncs += 1


class _FakeGraph:
    def __init__(self) -> None:
        self.launches = 0

    def launch(self) -> None:
        self.launches += 1


def _stub_backend(R: int):
    """A CudaBackend with only what execute() touches (host buffers, layouts), on a fake device."""
    from collections import Counter

    from hybrid_runtime.cuda.backend import CudaBackend, _Arena
    from hybrid_runtime.cuda.driver import DeviceArray

    be = object.__new__(CudaBackend)
    be.dev = _FakeDev()
    be.in_layout, be.out_layout = InputLayout(16, 8, 4), OutputLayout(8)

    class Pinned:
        def __init__(self, n: int) -> None:
            self.array, self.ptr = np.zeros(n, np.uint8), 0

    be.host_in, be.host_out = Pinned(be.in_layout.nbytes), Pinned(be.out_layout.nbytes)
    be.inp = DeviceArray(1 << 20, (be.in_layout.nbytes,), "uint8", 0)
    be.out = DeviceArray(2 << 20, (be.out_layout.nbytes,), "uint8", 0)
    be.arena = _Arena({"logits": DeviceArray(3 << 20, (8, 32), "float32", 0)})
    be.timings = Counter()
    be.cfg = type("Cfg", (), {"vocab_size": 32})()
    tok = be.host_out.array[be.out_layout.tokens:be.out_layout.tokens + 4 * R].view(np.int32)
    tok[:] = np.arange(R) + 7
    return be


def test_a_step_is_one_upload_and_one_download() -> None:
    """Eager or replayed: exactly one host-to-device copy of the step's inputs and one device-to-host copy of
    the sampled tokens (+ one more only when the caller asks for logits); one synchronisation."""
    from hybrid_runtime.backend import SampleRow
    from hybrid_runtime.cuda.backend import CudaCtx, Mat
    from hybrid_runtime.engine import Phase

    rows = [SampleRow(SamplingParams()), SampleRow(SamplingParams(), logprobs=2), SampleRow(SamplingParams())]
    for replay in (False, True):
        for want_logits in (False, True):
            be = _stub_backend(4)
            graph = _FakeGraph() if replay else None
            calls: list[str] = []

            def forward(ctx: CudaCtx, calls: list[str] = calls) -> Mat:
                calls.append("forward")
                return Mat(3 << 20, ctx.R, 32, 32, "float32")

            be._sample = lambda ctx, logits, calls=calls: calls.append("sample")  # type: ignore[method-assign]
            ctx = CudaCtx(Phase.DECODE, 4, 3, 4, 4, 3, 1, None, None, 4, rows, want_logits, upload_bytes=1234,
                          graph=graph)  # type: ignore[arg-type]
            res = be.execute(ctx, forward)
            assert be.dev.copies["htod"] == 1 and be.dev.last_up == 1234
            assert be.dev.copies["dtoh"] == 1 + int(want_logits) and be.dev.syncs == 1
            assert res.tokens.tolist() == [7, 8, 9]  # the padding row's token is dropped
            assert res.logprobs[0] is None and res.logprobs[1] is not None
            assert (res.logits is not None) == want_logits
            if graph is None:
                assert calls == ["forward", "sample"]
            else:
                assert calls == [] and graph.launches == 1


def test_moe_path_keeps_decode_classes_and_prefill_on_tensor_cores() -> None:
    """Which MoE kernels a step runs: prefill on tensor cores whenever they exist; decode by mode, "auto" (as
    "mma_decode") the weights-as-M decode kernels at every batch size; no tensor cores: CUDA cores always."""
    from hybrid_runtime.cuda.backend import FOLD_MAX_TOKENS, MOE_DECODE_MODES, moe_path

    assert MOE_DECODE_MODES == ("auto", "tensor_cores", "cuda_cores", "mma_decode")
    for n in (1, 7, FOLD_MAX_TOKENS, FOLD_MAX_TOKENS + 1, 64, 8192):
        assert moe_path(True, n, True, "cuda_cores") == "tensor_cores"
        assert moe_path(True, n, True, "mma_decode") == "tensor_cores"  # prefill never takes the decode kernels
        assert moe_path(True, n, False) == moe_path(False, n, False, "tensor_cores") == "cuda_cores"
        assert moe_path(False, n, False, "mma_decode") == moe_path(True, n, False, "mma_decode") == "cuda_cores"
        assert moe_path(False, n, True, "tensor_cores") == "tensor_cores"
        assert moe_path(False, n, True, "cuda_cores") == "cuda_cores"
        assert moe_path(False, n, True, "mma_decode") == "mma_decode"
        assert moe_path(False, n, True, "auto") == "mma_decode"
    with pytest.raises(ValueError, match="one of"):
        moe_path(False, 1, True, "fast")


def test_lru_cache_bounds_entries_and_evicts_the_least_recent() -> None:
    """The GEMM plan cache's policy (cuda/blas.py): at most ``capacity`` entries, a hit refreshes an entry, the
    least recently used one is handed to on_evict (the plan's descriptors are destroyed there) exactly once."""
    from hybrid_runtime.cuda.blas import LruCache

    gone: list[int] = []
    c: LruCache[str, int] = LruCache(3, gone.append)
    for i, k in enumerate("abc"):
        c.put(k, i)
    assert c.get("a") == 0  # a is now the most recent: b goes first
    c.put("d", 3)
    assert gone == [1] and "b" not in c and len(c) == 3 and c.evictions == 1
    for i in range(100):  # a long run of new keys (prefill steps' token counts) never grows it
        c.put(f"m{i}", 10 + i)
    assert len(c) == 3 and c.evictions == 101
    assert gone == [1, 2, 0, 3, *range(10, 107)] and all(f"m{i}" in c for i in (97, 98, 99))
    assert c.get("zz") is None
    with pytest.raises(ValueError):
        LruCache(0)


def _reduce_model(m: np.ndarray, l_: np.ndarray, o: np.ndarray, nblk: int, rgrp: int = 8, rbatch: int = 8
                  ) -> np.ndarray:
    """decode_attention.cu ``reduce_chunks`` for one (sequence, head), in float32 op for op: ``nblk`` chunks of
    which those past ``len(m)`` are empty (m = -inf, l = 0, o = 0, as the kernel stores empty chunks)."""
    f = np.float32
    ninf = f(-np.inf)
    D = o.shape[1]
    get = lambda c: (m[c], l_[c], o[c]) if c < len(m) else (ninf, f(0), np.zeros(D, f))  # noqa: E731
    gm, gl, acc_g = [], [], []
    for grp in range(rgrp):
        m_run, l_run, acc = ninf, f(0), np.zeros(D, f)
        for c0 in range(grp, nblk, rgrp * rbatch):
            loads = [get(c) if c < nblk else (ninf, f(0), np.zeros(D, f)) for c in (c0 + i * rgrp
                                                                                    for i in range(rbatch))]
            mb = m_run
            for mi, li, _ in loads:
                mb = max(mb, mi) if li > 0 else mb
            if mb == ninf:
                continue
            alpha = np.exp2(f(m_run - mb))
            acc, l_run = acc * alpha, f(l_run * alpha)
            for mi, li, oi in loads:
                w = np.exp2(f(mi - mb)) if li > 0 else f(0)
                acc, l_run = acc + w * oi, f(l_run + w * li)
            m_run = mb
        gm.append(m_run), gl.append(l_run), acc_g.append(acc)
    M = max(gm)
    go = [a * (f(0) if g == ninf else np.exp2(f(g - M))) for g, a in zip(gm, acc_g)]
    v, L = go[0], f(0) if gm[0] == ninf else f(gl[0] * np.exp2(f(gm[0] - M)))
    for i in range(1, rgrp):
        v = v + go[i]
        L = f(L + (f(0) if gm[i] == ninf else f(gl[i] * np.exp2(f(gm[i] - M)))))
    return v * f(f(1) / L)


def test_batch_invariant_split_follows_each_sequence_alone() -> None:
    """The batch-invariant decode-attention split (dispatcher.sequence_plan): a sequence's chunk length, the K/V
    tile, shared memory and the merge's CTA size are the same alone and in any batch; at most SEQ_CHUNKS chunks;
    the plan validates; and the merge (modelled op for op) gives the same float32 bits whatever number of
    trailing empty chunks the batch's grid adds."""
    from dataclasses import replace

    from hybrid_runtime.ops.dispatcher import SEQ_CHUNKS, next_pow2, sequence_chunk, sequence_plan

    rng = np.random.default_rng(0)
    for n in [1, 63, 64, 65, 1000, 1025, 4096, 32769, 262144, *rng.integers(1, 300_000, 50).tolist()]:
        c = sequence_chunk(n, H200)
        assert c % 64 == 0 and c >= H200.min_chunk_tokens and -(-n // c) <= SEQ_CHUNKS, n
    alone = sequence_plan(batch([5000]), H200)
    for others in ([1], [32768, 7], [100] * 63, [262000]):
        for pos in (0, len(others)):
            lens = [*others[:pos], 5000, *others[pos:]]
            p = sequence_plan(batch(lens, pages=100_000), H200)
            assert not validate(p, batch(lens, pages=100_000), H200, 1 << 30), lens
            assert p.seq_chunks is not None and alone.seq_chunks is not None
            assert p.seq_chunks[pos] == alone.seq_chunks[0]
            assert (p.kernel, p.kv_tile, p.smem_bytes, p.reduce_threads) == (MULTI, alone.kv_tile, alone.smem_bytes,
                                                                             alone.reduce_threads)
            cls = sequence_plan(batch(lens, pages=100_000), H200, next_pow2(p.blocks_per_seq))
            assert not validate(cls, batch(lens, pages=100_000), H200, 1 << 30) and cls.seq_chunks == p.seq_chunks
    assert sequence_plan(batch([1]), H200).blocks_per_seq == 2  # always the merge path, even for one chunk
    short = sequence_plan(batch([10, 20]), H200)
    assert validate(replace(short, seq_chunks=(64,)), batch([10, 20]), H200, 1 << 30)  # one chunk length short
    assert validate(replace(short, seq_chunks=(64, 8)), batch([10, 20]), H200, 1 << 30)  # 2 x 8 < 20 tokens
    # the merge: k real chunks then empty ones up to any grid size -> the same bits
    for k in (1, 2, 9, 17, 57, 64):
        m = (rng.standard_normal(k) * 3).astype(np.float32)
        l_ = rng.uniform(0.5, 40, k).astype(np.float32)
        o = rng.standard_normal((k, 4)).astype(np.float32) * l_[:, None]
        ref = _reduce_model(m, l_, o, max(k, 2))
        for nblk in {max(k, 2), next_pow2(max(k, 2)), 64}:
            assert _reduce_model(m, l_, o, nblk).view(np.uint32).tolist() == ref.view(np.uint32).tolist(), (k, nblk)


def test_batch_invariant_graph_classes_and_choice() -> None:
    """With the split on, graph classes are 2, 4, .. 64 and a step replays the power of two that holds its
    chunks, with its sequences' own chunk lengths; off (or mode off) the batch-dependent classes stay."""
    d = DecodeAttentionDispatcher("on", H200, 1 << 30, batch_invariant=True)
    assert class_blocks(d, batch([32768] * 4)) == [2, 4, 8, 16, 32, 64]
    assert class_blocks(d, batch([64] * 4)) == [2]
    b = batch([3000, 70, 1])
    c = choose(b, 4, d, lambda k: True, True)
    assert c.key == (4, 64) and c.plan is not None and c.plan.seq_chunks == (64, 64, 64)  # 3000 / 64 -> 47 chunks
    assert c.plan.blocks_per_seq == 64 and not validate(c.plan, b, H200, 1 << 30)
    assert d.select(b).blocks_per_seq == 47
    off = DecodeAttentionDispatcher("off", H200, 1 << 30, batch_invariant=True)
    assert off.select(b).kernel == SINGLE and class_blocks(off, batch([32768])) == [1]
    # a split the guard refuses (workspace) falls back to the batch-dependent plan, counted
    tight = DecodeAttentionDispatcher("on", H200, 4 << 20, batch_invariant=True)
    p = tight.select(batch([32768] * 8))
    assert p.seq_chunks is None and tight.fallbacks["sequence_split:workspace"] == 1


def test_device_waiting_is_set_only_while_synchronize_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CudaDevice.waiting`` (ServingEngine.device_wait, the response sender's gate) is set exactly while a
    thread blocks in ``synchronize`` — also when the synchronise raises (a lost device)."""
    import threading
    import types

    from hybrid_runtime.cuda import driver

    release, seen = threading.Event(), []
    dev = driver.CudaDevice.__new__(driver.CudaDevice)  # no GPU here: only what synchronize touches
    dev.waiting, dev.stream = threading.Event(), 0
    dev.activate = lambda: None  # type: ignore[method-assign]

    def sync(_stream: int) -> tuple[int]:
        seen.append(dev.waiting.is_set())
        release.wait(5.0)
        return (700 if len(seen) == 2 else 0,)  # the second call fails like CUDA_ERROR_ILLEGAL_ADDRESS

    monkeypatch.setattr(driver, "bindings", lambda: types.SimpleNamespace(cuStreamSynchronize=sync))
    monkeypatch.setattr(driver, "error_name", lambda code: f"CUresult {code}")
    assert not dev.waiting.is_set()
    t = threading.Thread(target=dev.synchronize)
    t.start()
    assert dev.waiting.wait(5.0)  # set while the thread blocks
    release.set()
    t.join(5.0)
    assert seen == [True] and not dev.waiting.is_set()
    with pytest.raises(driver.CudaError):
        dev.synchronize()
    assert not dev.waiting.is_set()


def test_graph_capture_pauses_the_garbage_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    """While ``CudaGraph`` captures, no cyclic collection runs (its finalizers would free device memory, which
    invalidates the capture); the collector is back on after a capture, also after one that fails, and stays off
    for a caller that had turned it off."""
    import gc
    import types

    from hybrid_runtime.cuda import driver

    events: list[str] = []

    class Cycle:  # garbage only a cyclic collection finds; its finalizer stands for a DeviceBuffer's cuMemFree
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            events.append("free")

    drv = types.SimpleNamespace(
        CUstreamCaptureMode=types.SimpleNamespace(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL=2),
        cuStreamBeginCapture=lambda stream, mode: (events.append("begin") or 0,),
        cuStreamEndCapture=lambda stream: (events.append("end") or 0, "graph"),
        cuGraphInstantiate=lambda graph, flags: (0, "exec"), cuGraphGetNodes=lambda graph, n: (0, None, 3),
        cuGraphDestroy=lambda graph: (0,))
    monkeypatch.setattr(driver, "bindings", lambda: drv)
    dev = types.SimpleNamespace(stream=0, activate=lambda: None)

    def body() -> None:  # a capture whose Python work allocates enough to trigger an automatic collection
        Cycle()
        _ = [[] for _ in range(20 * gc.get_threshold()[0])]
        events.append("launch")

    assert gc.isenabled()
    g = driver.CudaGraph(dev, body)  # type: ignore[arg-type]
    assert g.num_nodes == 3 and gc.isenabled()
    assert events == ["begin", "launch", "end"]  # nothing freed inside the capture
    gc.collect()
    assert events[-1] == "free"

    def failing() -> None:
        raise RuntimeError("launch refused")

    with pytest.raises(RuntimeError):
        driver.CudaGraph(dev, failing)  # type: ignore[arg-type]
    assert gc.isenabled()
    gc.disable()
    try:
        driver.CudaGraph(dev, body)  # type: ignore[arg-type]
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_tune_nbits_decode_times_each_packed_shape_once() -> None:
    """CudaBackend.tune_nbits_decode hands NBitsDecode.tune the packed-only linears grouped by (N, K, bits), only
    those the kernel takes, with one scratch x wide enough for every k_in (16-byte rows) and the 1 / max-bucket row
    counts (a fake device and a recording tune: the timing itself runs on the GPU, tests/gpu/test_nbits_gpu.py)."""
    from hybrid_runtime.cuda.backend import CudaBackend
    from hybrid_runtime.cuda.nbits_decode import DEFAULT_KNOBS, KNOB_SETS, NBitsOperand

    class Arr:
        def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
            self.shape, self.dtype, self.ptr = shape, dtype, 4096 * (1 + len(made))
            made.append(self)

    class Dev:
        def zeros(self, shape: tuple[int, ...], dtype: str) -> Arr:
            return Arr(shape, dtype)

        def empty(self, shape: tuple[int, ...], dtype: str) -> Arr:
            return Arr(shape, dtype)

        def synchronize(self) -> None:
            pass

    class Tuner:
        knobs = DEFAULT_KNOBS

        def __init__(self) -> None:
            self.choice: dict = {}
            self.calls: list = []

        def tune(self, shapes: dict, x: int, ldx: int, out: int, rows: list[int]) -> dict:
            self.calls.append((shapes, x, ldx, out, rows))
            for key in shapes:
                self.choice[key] = KNOB_SETS["u1"]
            return {key: {DEFAULT_KNOBS: 2e-6, KNOB_SETS["u1"]: 1e-6} for key in shapes}

    made: list[Arr] = []
    in_proj = [NBitsOperand(256 * i, 64, 0, 0, 2048, 12288, 4, 128, 2048) for i in (1, 2)]
    act_order = NBitsOperand(256 * 3, 64, 0, 64, 2048, 1024, 4, 128, 2030)  # k_in 2030: x rows padded to 2032+
    out_proj = NBitsOperand(256 * 4, 64, 0, 0, 4096, 2048, 8, 128, 4096)
    refused = NBitsOperand(256 * 5, 64, 0, 0, 64, 64, 4, 128, 64)  # K below its block: the scratch path
    be = object.__new__(CudaBackend)
    be.dtype, be.buckets, be.dev, be.nbits = "bfloat16", (1, 4, 32), Dev(), Tuner()
    be._nbits_ops = {op.B: op for op in (*in_proj, act_order, out_proj, refused)}
    be.tune_nbits_decode()
    assert len(be.nbits.calls) == 1
    shapes, x, ldx, out, rows = be.nbits.calls[0]
    assert shapes == {(12288, 2048, 4): in_proj, (1024, 2048, 4): [act_order], (2048, 4096, 8): [out_proj]}
    assert ldx == 4096 and rows == [1, 16]
    assert made[0].shape == (16, 4096) and made[0].dtype == "bfloat16" and x == made[0].ptr
    assert made[1].shape == (16, 12288) and made[1].dtype == "float32" and out == made[1].ptr
    assert be.nbits_tune_seconds >= 0.0 and set(be.nbits.choice) == set(shapes)
