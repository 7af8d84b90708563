"""Host side of the CUDA prefill attention (no GPU): the planner's work list, its refusals, the packed input
layout, and a numpy model of the kernel's tiling (row = token * G + head packing, 64-key tiles gathered
through the page tables per 16-key group, causal mask on the tiles that need it, warps skipping tiles their
rows precede, online softmax in the log2 domain) against dense causal attention. The model mirrors
``prefill_attention.cu`` index for index (not its fragments), so index and mask mistakes show up here."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hybrid_runtime.cuda.prefill_attention import (
    KEY_TILE,
    WARPS,
    WIDE_WARPS,
    PrefillAttentionError,
    PrefillPlan,
    choose_prefill_variant,
    pack_prefill_inputs,
    plan_prefill,
)
from hybrid_runtime.ops.dispatcher import DeviceLimits

LIM = DeviceLimits("fake-h200", sm_count=132)


def make_plan(q_lens, start_pos, hq=16, hkv=2, hd=256, dtype="bfloat16", ps=64, limits=LIM, m_tiles=None,
              warps=None):
    return plan_prefill(q_lens, start_pos, num_q_heads=hq, num_kv_heads=hkv, head_dim=hd, dtype=dtype,
                        page_size=ps, limits=limits, m_tiles=m_tiles, warps=warps)


@pytest.mark.parametrize("hq,hkv,hd,warps", [(16, 2, 256, None), (16, 2, 256, WARPS), (32, 8, 128, None),
                                             (8, 8, 64, None), (12, 4, 80, None), (16, 1, 128, WIDE_WARPS),
                                             (40, 8, 128, None), (64, 1, 64, None), (64, 1, 64, WIDE_WARPS)])
def test_work_list_covers_every_token_once(hq: int, hkv: int, hd: int, warps: int | None) -> None:
    rng = np.random.default_rng(hq * hd + hkv)
    q_lens = [int(x) for x in rng.integers(0, 300, size=7)] + [1, 0, 1000]
    start = [int(x) for x in rng.integers(0, 5000, size=len(q_lens))]
    p = make_plan(q_lens, start, hq, hkv, hd, warps=warps)
    G = hq // hkv
    assert p.variant.group == G and p.variant.tokens_per_tile == p.variant.rows // G
    assert p.grid == (p.n_work, hkv, 1) and p.block == (p.variant.warps * 32, 1, 1)
    assert p.work.dtype == np.int32 and p.work.shape == (p.n_work, 4) and not p.work.flags.writeable
    cu = p.cu_seqlens
    seen = np.zeros(p.num_tokens, np.int64)
    for s, row0, n, pos0 in p.work.tolist():
        assert 1 <= n <= p.variant.tokens_per_tile
        assert cu[s] <= row0 and row0 + n <= cu[s + 1], "a tile crosses a sequence"
        assert pos0 == start[s] + (row0 - cu[s])
        seen[row0:row0 + n] += 1
    assert (seen == 1).all()
    keys = p.work[:, 3] + p.work[:, 2]
    assert (np.diff(keys) <= 0).all(), "heaviest tiles first"
    exp_tiles = sum(-(-n // p.variant.tokens_per_tile) for n in q_lens)
    assert p.n_work == exp_tiles


def test_empty_batch_and_flops() -> None:
    p = make_plan([0, 0], [5, 0])
    assert p.n_work == 0 and p.num_tokens == 0 and p.grid[0] == 1
    p = make_plan([3, 2], [0, 4], hq=2, hkv=1, hd=16)
    # keys per query: 1 + 2 + 3 and 5 + 6
    assert p.causal_flops() == 4 * 2 * 16 * (6 + 11)


def test_refusals_name_what_to_change() -> None:
    with pytest.raises(PrefillAttentionError, match="float16 / bfloat16 only"):
        make_plan([4], [0], dtype="float32")
    with pytest.raises(PrefillAttentionError, match="head_dim 272"):
        make_plan([4], [0], hd=272)
    with pytest.raises(PrefillAttentionError, match="multiple of 16"):
        make_plan([4], [0], hd=72)
    with pytest.raises(PrefillAttentionError, match="page_size 8"):
        make_plan([4], [0], ps=8)
    with pytest.raises(PrefillAttentionError, match="page_size 40"):
        make_plan([4], [0], ps=40)
    with pytest.raises(PrefillAttentionError, match="GQA group"):
        make_plan([4], [0], hq=256, hkv=1)  # 128 rows per tile at hd 256
    with pytest.raises(PrefillAttentionError, match="GQA group"):
        make_plan([4], [0], hq=128, hkv=1, warps=WARPS)
    with pytest.raises(PrefillAttentionError, match="multiple of num_kv_heads"):
        make_plan([4], [0], hq=12, hkv=5)
    with pytest.raises(PrefillAttentionError, match="shared memory"):
        make_plan([4], [0], limits=DeviceLimits("small", sm_count=1, max_shared_mem_optin=64 * 1024))
    with pytest.raises(PrefillAttentionError, match="warps=4"):  # the 8-warp build's 192 KB; the 4-warp one fits
        make_plan([4], [0], limits=DeviceLimits("a100ish", sm_count=1, max_shared_mem_optin=163 * 1024))
    assert make_plan([4], [0], warps=WARPS, limits=DeviceLimits("a100ish", sm_count=1,
                                                                max_shared_mem_optin=163 * 1024)).n_work == 1
    with pytest.raises(PrefillAttentionError, match="threads per block"):
        make_plan([4], [0], limits=DeviceLimits("narrow", sm_count=1, max_threads_per_block=128))
    with pytest.raises(PrefillAttentionError, match="max grid x"):
        make_plan([200], [0], limits=DeviceLimits("tiny", sm_count=1, max_grid_x=8))
    with pytest.raises(PrefillAttentionError, match="max grid y"):
        make_plan([1], [0], hq=70000, hkv=70000, hd=16)
    with pytest.raises(PrefillAttentionError, match="q_lens"):
        make_plan([1, 2], [0])
    with pytest.raises(PrefillAttentionError, match="m_tiles"):
        choose_prefill_variant("bfloat16", 128, 8, m_tiles=3)
    with pytest.raises(PrefillAttentionError, match="warps must be"):
        choose_prefill_variant("bfloat16", 128, 8, warps=6)


def test_variants_and_shared_memory() -> None:
    v = choose_prefill_variant("bfloat16", 256, 8)  # the default at hd 256: 8 warps, 128 rows, 2 K/V stages
    assert (v.warps, v.stages, v.threads, v.m_tiles, v.rows, v.tokens_per_tile) == (8, 2, 256, 1, 128, 16)
    assert v.smem_bytes == (128 + 2 * 128) * 256 * 2 == 192 * 1024
    assert v.options == ("-DHD=256", "-DDT=2", "-DG=8", "-DMT=1", "-DNWARPS=8", "-DSTAGES=2")
    v = choose_prefill_variant("bfloat16", 256, 8, warps=4)  # the 64-row single-buffered build
    assert (v.stages, v.threads, v.rows, v.tokens_per_tile, v.smem_bytes) == (1, 128, 64, 8, (64 + 128) * 256 * 2)
    assert v.options == ("-DHD=256", "-DDT=2", "-DG=8", "-DMT=1", "-DNWARPS=4", "-DSTAGES=1")
    v = choose_prefill_variant("float16", 64, 4)
    assert (v.warps, v.m_tiles, v.rows, v.tokens_per_tile) == (4, 2, 128, 32)
    assert choose_prefill_variant("float16", 128, 3).tokens_per_tile == 21  # 63 rows used, 1 padding row
    assert choose_prefill_variant("bfloat16", 144, 8).warps == 8
    assert choose_prefill_variant("bfloat16", 128, 8).warps == 4
    for hd in range(16, 257, 16):
        for mt in (1, 2):
            for w in (WARPS, WIDE_WARPS):
                if w == WARPS or mt == 1 or hd <= 224:  # 8 warps x 2 m-tiles: 256 rows
                    assert choose_prefill_variant("bfloat16", hd, 1, mt, w).smem_bytes <= LIM.max_shared_mem_optin


def test_pack_layout() -> None:
    p = make_plan([70, 5, 1], [100, 0, 63], ps=16)
    tables = [np.arange(11), np.array([40]), np.array([7, 3, 9, 12])]
    packed = pack_prefill_inputs(p, tables)
    h = packed.host
    assert h.dtype == np.int32 and packed.work_offset == 0
    assert packed.tables_offset % 32 == 0 and packed.tables_offset >= 4 * p.n_work
    assert (h[:4 * p.n_work].reshape(-1, 4) == p.work).all()
    assert not h[4 * p.n_work:packed.tables_offset].any()
    st, to = packed.table_stride, packed.tables_offset
    assert st == 11 and len(h) == to + 3 * st
    assert h[to:to + 11].tolist() == list(range(11))
    assert h[to + st:to + 2 * st].tolist() == [40] + [0] * 10
    assert h[to + 2 * st:to + 2 * st + 4].tolist() == [7, 3, 9, 12]
    assert pack_prefill_inputs(p, tables, table_stride=16).table_stride == 16
    with pytest.raises(PrefillAttentionError, match="stride"):
        pack_prefill_inputs(p, tables, table_stride=4)
    with pytest.raises(PrefillAttentionError, match="page table 0 has 10 pages"):
        pack_prefill_inputs(p, [np.arange(10), *tables[1:]])  # positions 0..169 need 11 pages of 16
    with pytest.raises(IndexError):
        pack_prefill_inputs(p, [tables[0], np.array([-1]), tables[2]])
    with pytest.raises(PrefillAttentionError, match="3 sequences"):
        pack_prefill_inputs(p, tables[:2])


# ----------------------------------------------------------------------------- numpy model of the kernel


def kernel_model(p: PrefillPlan, packed, q: np.ndarray, kpool: np.ndarray, vpool: np.ndarray) -> np.ndarray:
    """What prefill_attn computes, by its own indexing: q [n_tokens, Hq, hd], pools [pages, ps, Hkv, hd] ->
    out [n_tokens, Hq, hd] float64. Reads the work list and the tables from the packed host array."""
    v = p.variant
    G, BM, BN, hd = v.group, v.rows, KEY_TILE, p.head_dim
    Hq, Hkv, ps = p.num_q_heads, p.num_kv_heads, p.page_size
    TOKB = BM // G
    RUSED = TOKB * G
    rows_per_warp = 16 * v.m_tiles
    nwarps = v.warps
    kflat = kpool.reshape(-1, hd)  # pool row (page * ps + off) * Hkv + kvh
    vflat = vpool.reshape(-1, hd)
    h = packed.host
    work = h[packed.work_offset:packed.work_offset + 4 * p.n_work].reshape(-1, 4)
    out = np.full((q.shape[0], Hq, hd), np.nan)
    for seq, qrow0, ntok, qpos0 in work.tolist():
        table = h[packed.tables_offset + seq * packed.table_stride:]
        kv_len = qpos0 + ntok
        nkt = -(-kv_len // BN)
        for kvh in range(Hkv):
            h0 = kvh * G
            r = np.arange(BM)
            tok, hg = r // G, r % G
            ok = (r < RUSED) & (tok < ntok)
            qt = np.zeros((BM, hd))
            qt[ok] = q[qrow0 + tok[ok], h0 + hg[ok]]
            rpos = qpos0 + np.minimum(tok, ntok - 1)
            warp_maxpos = [qpos0 + min((w * rows_per_warp + rows_per_warp - 1) // G, ntok - 1) for w in range(nwarps)]
            warp_live = [w * rows_per_warp < ntok * G for w in range(nwarps)]
            m = np.full(BM, -np.inf)
            l = np.zeros(BM)
            o = np.zeros((BM, hd))
            sl2 = p.scale_log2
            for j in range(nkt):
                n0 = j * BN
                nvalid = min(BN, kv_len - n0)
                base = []
                for gi in range(BN // 16):
                    pp = n0 + 16 * gi
                    if pp < kv_len:
                        pi = pp // ps
                        base.append((int(table[pi]) * ps + (pp - pi * ps)) * Hkv + kvh)
                    else:
                        base.append(-1)
                kt = np.zeros((BN, hd))
                vt = np.zeros((BN, hd))
                for rr in range(nvalid):
                    row = base[rr >> 4] + (rr & 15) * Hkv
                    kt[rr] = kflat[row]
                    vt[rr] = vflat[row]
                s = qt @ kt.T
                if n0 + BN - 1 > qpos0:
                    keys = n0 + np.arange(BN)
                    s = np.where(keys[None, :] > rpos[:, None], -np.inf, s)
                for w in range(nwarps):
                    if not (warp_live[w] and n0 <= warp_maxpos[w]):
                        continue
                    sl = slice(w * rows_per_warp, (w + 1) * rows_per_warp)
                    mx = s[sl].max(axis=1)
                    m_new = np.maximum(m[sl], mx * sl2)
                    assert np.isfinite(m_new).all()
                    alpha = np.exp2(m[sl] - m_new)
                    pm = np.exp2(s[sl] * sl2 - m_new[:, None])
                    l[sl] = l[sl] * alpha + pm.sum(axis=1)
                    o[sl] = o[sl] * alpha[:, None] + pm @ vt
                    m[sl] = m_new
            for rr in np.nonzero(ok)[0]:
                out[qrow0 + tok[rr], h0 + hg[rr]] = o[rr] / l[rr]
    return out


def dense_reference(q, kpool, vpool, tables, q_lens, start_pos) -> np.ndarray:
    n, hq, hd = q.shape
    hkv = kpool.shape[2]
    G = hq // hkv
    out = np.zeros((n, hq, hd))
    row = 0
    for s, (ln, st) in enumerate(zip(q_lens, start_pos)):
        keys = np.asarray(kpool)[tables[s]].reshape(-1, hkv, hd)[:st + ln]
        vals = np.asarray(vpool)[tables[s]].reshape(-1, hkv, hd)[:st + ln]
        for i in range(ln):
            pos = st + i
            for h in range(hq):
                sc = keys[:pos + 1, h // G] @ q[row + i, h] / math.sqrt(hd)
                w = np.exp(sc - sc.max())
                out[row + i, h] = (w / w.sum()) @ vals[:pos + 1, h // G]
        row += ln
    return out


def random_case(rng, q_lens, start_pos, hq, hkv, hd, ps, extra_pages=5):
    need = [-(-(a + b) // ps) for a, b in zip(q_lens, start_pos)]
    pages = sum(need) + extra_pages
    perm = rng.permutation(pages)
    cs = np.cumsum([0, *need])
    tables = [perm[cs[i]:cs[i + 1]] for i in range(len(q_lens))]
    k = rng.standard_normal((pages, ps, hkv, hd))
    v = rng.standard_normal((pages, ps, hkv, hd))
    q = rng.standard_normal((sum(q_lens), hq, hd))
    return q, k, v, tables


@pytest.mark.parametrize("case", [
    # (q_lens, start_pos, Hq, Hkv, hd, page_size, m_tiles, warps)
    ([70, 1, 33], [0, 5, 64], 16, 2, 32, 16, None, None),  # G 8: 8 tokens per tile, mid-page starts
    ([100], [37], 4, 4, 16, 16, 1, None),  # G 1: 64 tokens per tile, several warps skip diagonal tiles
    ([130, 9], [200, 0], 8, 2, 16, 48, 2, None),  # G 4, 128-row tiles, page size 48 (tiles span pages)
    ([40, 17], [3, 120], 6, 2, 16, 32, 1, None),  # G 3: a padding row per tile
    ([5, 64, 2], [63, 0, 1], 16, 1, 16, 16, 1, None),  # G 16: 4 tokens per tile
    ([1, 1, 1], [0, 200, 15], 2, 1, 16, 64, 1, None),  # single tokens (decode-like) past cached pages
    ([70, 1, 33], [0, 5, 64], 16, 2, 32, 16, 1, WIDE_WARPS),  # 8 warps, G 8: 16 tokens per 128-row tile
    ([130, 9], [200, 0], 6, 2, 16, 48, 1, WIDE_WARPS),  # 8 warps, G 3: 42 tokens + 2 padding rows
    ([300], [10], 2, 2, 16, 16, 2, WIDE_WARPS),  # 8 warps x 2 m-tiles, G 1: 256 tokens, warps skip tiles
])
def test_kernel_model_matches_dense_causal_attention(case) -> None:
    q_lens, start_pos, hq, hkv, hd, ps, mt, warps = case
    rng = np.random.default_rng(sum(q_lens) + hq)
    q, k, v, tables = random_case(rng, q_lens, start_pos, hq, hkv, hd, ps)
    p = make_plan(q_lens, start_pos, hq, hkv, hd, ps=ps, m_tiles=mt, warps=warps)
    packed = pack_prefill_inputs(p, tables)
    got = kernel_model(p, packed, q, k, v)
    ref = dense_reference(q, k, v, tables, q_lens, start_pos)
    assert np.isfinite(got).all(), "a query row was never written"
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)
