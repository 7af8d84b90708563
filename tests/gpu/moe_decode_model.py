"""A numpy model of ``ops/cuda/moe_decode.cu`` (no GPU), every index expression transcribed from the kernel:

* :func:`coverage`: which CTA of which grid writes which (pair, row) - the grids of ``cuda/moe_decode.py``, the
  CTAs past ``active[E_all]`` exiting, the passes of ``8 * gcap`` pairs, the groups, the epilogue's warp /
  fragment / lane split - as write counts (the tests want exactly one per (pair, row) of the step);
* :func:`cta_model`: one CTA lane by lane - the cp.async chunk mapping into the swizzled ring stages (a
  refilled slot holds NaN wherever this k tile wrote nothing, so reading a chunk that was not loaded shows),
  ldmatrix .x4 / .x2 lane addressing, the mma.sync m16n8k16 fragments as the PTX ISA defines them
  (``moe_gemm_model._mma``), the split-K over warps and their sum in warp order, the epilogues.

Not modelled: when copies are issued and how they are committed (the ``early`` knob moves the first pass's
weight copies ahead; the kernel's comments argue the wait counts), and the L2 prefetch (``pf_mb``: a hint).
"""

from __future__ import annotations

import numpy as np
from moe_gemm_model import _mma

from hybrid_runtime.cuda.moe_decode import DecodeKnobs, grid


def routing(pair_e: np.ndarray, e_all: int, rng: np.random.Generator | None = None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(expert_off [E_all+1], pair_list [pairs], active [E_all+1]) as moe_route writes them for ``pair_e``: the
    pairs grouped by expert (shuffled within an expert when ``rng`` is given: moe_route's order is not fixed)."""
    counts = np.bincount(pair_e, minlength=e_all)
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    pair_list = np.argsort(pair_e, kind="stable").astype(np.int64)
    if rng is not None:
        for e in range(e_all):
            rng.shuffle(pair_list[off[e]:off[e + 1]])
    act = np.nonzero(counts)[0]
    active = np.zeros(e_all + 1, np.int64)
    active[:len(act)] = act
    active[e_all] = len(act)
    return off, pair_list, active


def _cta_pairs(by: int, e_all: int, gcap: int, kn: DecodeKnobs, off: np.ndarray, pair_list: np.ndarray,
               active: np.ndarray) -> list[tuple[int, int, list[int]]]:
    """The passes of CTA row ``by``: [(m, ng, s_pair)], [] when it exits (by >= active[E_all])."""
    if by >= active[e_all]:
        return []
    e = int(active[by])
    p0, p1 = int(off[e]), int(off[e + 1])
    gcap = min(max(gcap, 1), kn.gmax)
    cap = 8 * gcap
    out = []
    for base in range(p0, p1, cap):
        m = min(cap, p1 - base)
        ng = (m + 7) >> 3
        out.append((m, ng, [int(pair_list[base + r]) if r < m else -1 for r in range(8 * ng)]))
    return out


def _cta_writes(kind: str, m: int, ng: int, kn: DecodeKnobs) -> tuple[np.ndarray, np.ndarray]:
    """(pass column q, row within the CTA's block) of every element one pass of m pairs writes: the epilogue's
    fragments f = warp, warp + warps, ... < MT * ng, lanes (rows gl, gl + 8; columns 2 t4, 2 t4 + 1)."""
    mt_n = kn.rows(kind) // 16
    lane = np.arange(32)
    gl, t4 = lane >> 2, lane & 3
    qs, rs = [], []
    for warp in range(kn.warps):
        for f in range(warp, mt_n * ng, kn.warps):
            mt, g = f // ng, f - (f // ng) * ng
            for c in range(2):
                q = 8 * g + 2 * t4 + c
                ok = q < m
                if kind == "gate_up":
                    qs.append(q[ok])
                    rs.append(mt * 8 + gl[ok])
                else:
                    qs += [q[ok], q[ok]]
                    rs += [mt * 16 + gl[ok], mt * 16 + gl[ok] + 8]
    return np.concatenate(qs), np.concatenate(rs)


def coverage(kind: str, n: int, kk: int, e_all: int, H: int, I: int, gcap: int, kn: DecodeKnobs,
             off: np.ndarray, pair_list: np.ndarray, active: np.ndarray) -> np.ndarray:
    """Write counts [n*kk, I] (gate_up: act columns) or [n*kk, H] (down: y rows of each pair's slot)."""
    gx, gy, _ = grid(kind, n, kk, e_all, H, I, kn)
    block = kn.gu_cols if kind == "gate_up" else kn.rows(kind)  # act columns / y rows per CTA
    cnt = np.zeros((n * kk, I if kind == "gate_up" else H), np.int64)
    cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    for by in range(gy):
        for m, ng, s_pair in _cta_pairs(by, e_all, gcap, kn, off, pair_list, active):
            if (m, ng) not in cache:
                cache[m, ng] = _cta_writes(kind, m, ng, kn)
            q, r = cache[m, ng]
            p = np.array(s_pair)[q]
            rows = (np.arange(gx)[:, None] * block + r[None, :]).ravel()  # every CTA bx of this row
            np.add.at(cnt, (np.tile(p, gx), rows), 1)
    return cnt


def _ldsm(stage: np.ndarray, rows: np.ndarray, chunks: np.ndarray, nmat: int) -> np.ndarray:
    """ldmatrix (non-trans) .x4 / .x2 on a stage array [rows, physical chunk, 8]: lane l addresses (rows[l],
    logical chunk chunks[l]) -> physical chunk chunks ^ (rows & 7) (soff); matrix j takes lanes 8j .. 8j + 7.
    Returns [nmat regs, 32 lanes, 2]: lane i holds row i // 4, elements 2 (i % 4), +1 of each matrix."""
    phys = chunks ^ (rows & 7)
    lane = np.arange(32)
    out = []
    for j in range(nmat):
        mat = stage[rows[8 * j:8 * j + 8], phys[8 * j:8 * j + 8]]  # [8 rows, 8 elements]
        out.append(np.stack([mat[lane // 4, 2 * (lane % 4)], mat[lane // 4, 2 * (lane % 4) + 1]], -1))
    return np.stack(out)


def cta_model(kind: str, X: np.ndarray, ldx: int, W: np.ndarray, K: int, H: int, I: int, kk: int, ny: int,
              e_all: int, gcap: int, kn: DecodeKnobs, off: np.ndarray, pair_list: np.ndarray, active: np.ndarray,
              pair_w: np.ndarray | None, bx: int, by: int, out: np.ndarray) -> None:
    """CTA (bx, by) of moe_dec_gate_up (``kind`` "gate_up": X = h flat [n*ldx], W = w_gu flat [E_all*2I*H],
    out = act flat [pairs*I]) or moe_dec_down ("down": X = act flat [pairs*I], W = w_d flat, out = y flat
    [n*ny*H]), float64."""
    rm = kn.rows(kind)
    mt_n, cpr, threads, stages = rm // 16, kn.bk // 8, kn.threads, kn.stages(kind)
    nch, spw = rm * cpr // threads, kn.bk // 16 // kn.warps
    passes = _cta_pairs(by, e_all, gcap, kn, off, pair_list, active)
    if not passes:
        return
    e = int(active[by])
    gcap = min(max(gcap, 1), kn.gmax)
    cap = 8 * gcap
    kt_n = -(-K // kn.bk)
    tail_ch = (K - (kt_n - 1) * kn.bk) >> 3
    wmap = []  # (thread, i) -> (smem row, chunk, source element)
    for tid in range(threads):
        for i in range(nch):
            c = tid + i * threads
            row, ch = c // cpr, c % cpr
            if kind == "gate_up":
                grow = e * 2 * I + (0 if (row & 15) < 8 else I) + bx * kn.gu_cols + (row >> 4) * 8 + (row & 7)
            else:
                grow = e * H + bx * rm + row
            wmap.append((row, ch, grow * K + ch * 8))
    lane = np.arange(32)
    for m, ng, s_pair in passes:
        s_src = [-1 if p < 0 else ((p // kk) * ldx if kind == "gate_up" else p * ldx) for p in s_pair]
        ring = [(np.full((rm, cpr, 8), np.nan), np.full((cap, cpr, 8), np.nan)) for _ in range(stages)]

        def load_stage(slot: int, kt: int, ring=ring, ng=ng, s_src=s_src) -> None:
            sw, sb = ring[slot]
            sw[:] = np.nan  # what this refill does not write is stale: never to be read
            sb[:] = np.nan
            k0 = kt * kn.bk
            nchk = tail_ch if kt == kt_n - 1 else cpr
            for row, ch, src in wmap:
                if ch < nchk:
                    sw[row, ch ^ (row & 7)] = W[src + k0:src + k0 + 8]
            for c in range(8 * ng * cpr):
                row, ch = c // cpr, c % cpr
                if ch < nchk:
                    src = s_src[row]
                    sb[row, ch ^ (row & 7)] = 0.0 if src < 0 else X[src + k0 + ch * 8:src + k0 + ch * 8 + 8]

        acc = np.zeros((kn.warps, mt_n, kn.gmax, 32, 4))
        for s in range(stages - 1):
            if s < kt_n:
                load_stage(s, s)
        for kt in range(kt_n):
            nk = kt + stages - 1
            if nk < kt_n:  # on the GPU this refill overlaps the compute of kt: it must be another slot
                assert nk % stages != kt % stages
                load_stage(nk % stages, nk)
            sw, sb = ring[kt % stages]
            nsteps = (tail_ch if kt == kt_n - 1 else cpr) >> 1
            for warp in range(kn.warps):
                for ss in range(spw):
                    ks = warp * spw + ss
                    if ks >= nsteps:
                        break
                    b = [_ldsm(sb, 8 * g + (lane & 7), 2 * ks + ((lane >> 3) & 1), 2) for g in range(ng)]
                    for mt in range(mt_n):
                        a = _ldsm(sw, mt * 16 + (lane & 15), 2 * ks + (lane >> 4), 4)
                        for g in range(ng):
                            _mma(acc[warp, mt, g], a, b[g])
        gl, t4 = lane >> 2, lane & 3
        for f in range(mt_n * ng):  # (warp f % warps runs it; the sum is in warp order whatever the warp)
            mt, g = f // ng, f - (f // ng) * ng
            v = acc[0, mt, g].copy()
            for w in range(1, kn.warps):
                v += acc[w, mt, g]
            for ln in range(32):
                for c in range(2):
                    q = 8 * g + 2 * t4[ln] + c
                    if q >= m:
                        continue
                    p = s_pair[q]
                    lo, hi = v[ln, c], v[ln, 2 + c]
                    if kind == "gate_up":
                        i = bx * kn.gu_cols + mt * 8 + gl[ln]
                        out[p * I + i] = lo / (1 + np.exp(-lo)) * hi
                    else:
                        assert pair_w is not None
                        t, slot = p // kk, p % kk
                        dst = (t * ny + slot) * H + bx * rm + mt * 16 + gl[ln]
                        out[dst] = pair_w[p] * lo
                        out[dst + 8] = pair_w[p] * hi
