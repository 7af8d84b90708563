"""A lane-level numpy model of ``ops/cuda/moe_gemm.cu`` (no GPU): the grouping of ``moe_group`` (per-CTA counts,
scans, the warp-by-warp placement of pairs, the tile list) and one CTA of the grouped GEMMs (the cp.async
chunk mapping into the swizzled stage ring, ldmatrix lane addressing, the mma.sync m16n8k16 fragments as the
PTX ISA defines them, the epilogues' row/column mapping). Every index expression is transcribed from the
kernel, so a slip there shows up here as a wrong product on a CPU."""

from __future__ import annotations

import numpy as np

BM, BN, BK, STAGES, THREADS = 128, 128, 64, 3, 128


def swz(row: int | np.ndarray, c: int | np.ndarray) -> int | np.ndarray:
    return c ^ (row & 7)


# ---------------------------------------------------------------------------------------------- moe_group


def group_model(pair_e: np.ndarray, n: int, kk: int, e_all: int, chunk: int, bm: int = BM
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(expert_off [E_all+1], pair_list [n*kk], active [E_all+1], tiles [count, 3]) as moe_topk's counts and
    moe_group compute them (CTA by CTA, warp by warp)."""
    ncta = -(-n // chunk)
    counts = np.zeros((ncta, e_all), np.int64)
    for c in range(ncta):  # moe_topk: per-CTA counts of its tokens' pairs
        t0, t1 = c * chunk, min(n, (c + 1) * chunk)
        for q in range(t0 * kk, t1 * kk):
            counts[c, pair_e[q]] += 1
    total = counts.sum(0)
    off = np.concatenate([[0], np.cumsum(total)[:-1]])
    expert_off = np.append(off, total.sum())
    act = [e for e in range(e_all) if total[e] > 0]
    active = np.zeros(e_all + 1, np.int64)
    active[:len(act)] = act
    active[e_all] = len(act)
    nt = -(-total // bm)
    tile0 = np.concatenate([[0], np.cumsum(nt)[:-1]])
    tiles = np.zeros((int(nt.sum()), 3), np.int64)
    for e in range(e_all):
        for j in range(int(nt[e])):
            tiles[tile0[e] + j] = (e, off[e] + j * bm, min(bm, total[e] - j * bm))
    pair_list = np.full(n * kk, -1, np.int64)
    for c in range(ncta):
        cursor = off + counts[:c].sum(0)
        p0, p1 = c * chunk * kk, min(n, (c + 1) * chunk) * kk
        for base in range(p0, p1, 1024):
            warps = (min(1024, p1 - base) + 31) >> 5
            for w in range(warps):
                qs = np.arange(base + 32 * w, base + 32 * w + 32)
                es = np.where(qs < p1, pair_e[np.minimum(qs, len(pair_e) - 1)], -1)
                pos = np.zeros(32, np.int64)
                for lane in range(32):  # __match_any_sync + popc of the lower lanes
                    same = es == es[lane]
                    rank = int(same[:lane].sum())
                    if qs[lane] < p1:
                        pos[lane] = cursor[es[lane]] + rank
                for lane in range(32):
                    if qs[lane] < p1:
                        pair_list[pos[lane]] = qs[lane]
                        same = np.nonzero(es == es[lane])[0]
                        if lane == same[-1]:
                            cursor[es[lane]] += len(same)
    return expert_off, pair_list, active, tiles


# ---------------------------------------------------------------------------------------------- GEMM CTA


def _ldsm_x4(smem: np.ndarray, rows: np.ndarray, chunks: np.ndarray) -> np.ndarray:
    """ldmatrix.x4 (non-trans): lane l gives the address (row, physical chunk) of row l & 7 of matrix l >> 3;
    returns [4 regs, 32 lanes, 2 elements]: lane i holds row i // 4, elements 2 (i % 4), +1 of each matrix."""
    mats = np.stack([smem[rows[8 * j:8 * j + 8], chunks[8 * j:8 * j + 8]] for j in range(4)])  # [4, 8, 8]
    lane = np.arange(32)
    return np.stack([np.stack([mats[j][lane // 4, 2 * (lane % 4)], mats[j][lane // 4, 2 * (lane % 4) + 1]], -1)
                     for j in range(4)])


def _mma(d: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """d [32, 4] += A [16x16] @ B [16x8] from the PTX fragments: a [4 regs, 32, 2], b [2 regs, 32, 2]."""
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for r, (ro, co) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8)]):
        for e in range(2):
            A[g + ro, 2 * t + co + e] = a[r, :, e]
    for r, ko in enumerate([0, 8]):
        for e in range(2):
            B[2 * t + ko + e, g] = b[r, :, e]
    C = A @ B
    for r, ro in enumerate([0, 0, 8, 8]):
        d[:, r] += C[g + ro, 2 * t + (r % 2)]


def gemm_cta_model(mode: str, A: np.ndarray, lda: int, W: np.ndarray, K: int, I: int, H: int, kk: int, ny: int,
                   tile: tuple[int, int, int], pair_list: np.ndarray, pair_w: np.ndarray | None, bx: int,
                   out: np.ndarray) -> None:
    """CTA (bx, tile) of moe_gemm_gate_up (``mode`` "gate_up": A = h flat, W = w_gu flat [E_all*2I*H], out =
    act flat [pairs*I]) or moe_gemm_down ("down": A = act flat, W = w_d flat, out = y flat [n*ny*H])."""
    e, start, rows = tile
    s_pair = np.array([pair_list[start + r] if r < rows else -1 for r in range(BM)])
    s_src = np.array([-1 if p < 0 else ((p // kk) * lda if mode == "gate_up" else p * lda) for p in s_pair])
    ring = [(np.zeros((BM, 8, 8)), np.zeros((BN, 8, 8))) for _ in range(STAGES)]  # [row][phys chunk][8]
    if mode == "gate_up":
        wb0, up_jump = e * 2 * I * K + bx * 64 * K, (I - 64) * K
    else:
        wb0, up_jump = e * H * K + bx * BN * K, 0

    def load_stage(stage: int, kt: int) -> None:
        sA, sB = ring[stage]
        k0 = kt * BK
        for tid in range(THREADS):
            ch, r0 = tid & 7, tid >> 3
            for i in range(BM // 16):
                row = r0 + 16 * i
                src = s_src[row]
                sA[row, swz(row, ch)] = 0.0 if src < 0 else A[src + k0 + ch * 8:src + k0 + ch * 8 + 8]
            for i in range(BN // 16):
                row = r0 + 16 * i
                s = wb0 + r0 * K + ch * 8 + 16 * i * K + (up_jump if i >= 4 else 0) + k0
                sB[row, swz(row, ch)] = W[s:s + 8]

    KT = K // BK
    acc = np.zeros((4, 4, 8, 32, 4))  # [warp][mt][nt][lane][4]
    for s in range(STAGES - 1):
        if s < KT:
            load_stage(s, s)
    lane = np.arange(32)
    a_row, a_ch = lane & 15, lane >> 4
    b_row, b_ch = (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1
    for kt in range(KT):
        nk = kt + STAGES - 1
        if nk < KT:  # (on the GPU the refill overlaps the compute below; it targets the stage kt - 1 used)
            assert nk % STAGES != kt % STAGES
        sA, sB = ring[kt % STAGES]
        for warp in range(4):
            wm, wn = warp >> 1, warp & 1
            mrows = rows - wm * 64
            if mrows <= 0:
                continue
            for ks in range(BK // 16):
                b = np.zeros((8, 2, 32, 2))
                for np_ in range(4):
                    base = (np_ * 16 + wn * 32 if np_ < 2 else 64 + wn * 32 + (np_ - 2) * 16) if mode == "gate_up" \
                        else wn * 64 + np_ * 16
                    row = base + b_row
                    r = _ldsm_x4(sB, row, swz(row, 2 * ks + b_ch))
                    b[2 * np_] = r[0:2]
                    b[2 * np_ + 1] = r[2:4]
                for mt in range(4):
                    if mt * 16 < mrows:
                        row = wm * 64 + mt * 16 + a_row
                        a = _ldsm_x4(sA, row, swz(row, 2 * ks + a_ch))
                        for nt in range(8):
                            _mma(acc[warp, mt, nt], a, b[nt])
        if nk < KT:
            load_stage(nk % STAGES, nk)
    for warp in range(4):
        wm, wn = warp >> 1, warp & 1
        for ln in range(32):
            g, t4 = ln >> 2, ln & 3
            for mt in range(4):
                for hi in range(2):
                    r = wm * 64 + mt * 16 + g + hi * 8
                    if r >= rows:
                        continue
                    p = s_pair[r]
                    ac = acc[warp, mt, :, ln]
                    if mode == "gate_up":
                        dst = p * I + bx * 64 + wn * 32 + 2 * t4
                        for nt in range(4):
                            for c in range(2):
                                gv, uv = ac[nt, 2 * hi + c], ac[nt + 4, 2 * hi + c]
                                out[dst + nt * 8 + c] = gv / (1 + np.exp(-gv)) * uv
                    else:
                        t, slot = p // kk, p % kk
                        assert pair_w is not None
                        dst = (t * ny + slot) * H + bx * BN + wn * 64 + 2 * t4
                        for nt in range(8):
                            for c in range(2):
                                out[dst + nt * 8 + c] = pair_w[p] * ac[nt, 2 * hi + c]
