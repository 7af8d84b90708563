"""A numpy model of what ``ops/cuda/moe_nbits_decode.cu`` adds to moe_decode.cu (no GPU), every index expression
transcribed from the kernel: the packed cp.async chunk mapping of a CTA's weight rows into a ring stage (rows of
bk * bits / 8 bytes, short last k tiles), the (scale, 2^23 + zero) table of the CTA's rows, and the dequantisation of
a stage into the swizzled T tile (8 codes a thread-chunk: nibble / byte order, the block of each chunk, float32
(q - z) * s rounded once to T). :func:`wt_tiles` returns, per k tile, the T weights the mma loop then reads; the
rest of the kernel is moe_decode.cu's, modelled by moe_decode_model.py.

:func:`reg_fragments` models the ``reg`` 1 builds lane by lane (the swizzled packed stage, the [block][row] table, each
lane's A fragment codes and their mma slots).

Not modelled: when copies land (the ring's wait counts are moe_decode's) and the __syncthreads that publish WT."""

from __future__ import annotations

import numpy as np
from gpu_bits import host_bits, to_f32

from hybrid_runtime.cuda.moe_nbits_decode import HostExperts, NBitsKnobs


def _global_row(kind: str, row: int, e: int, bx: int, H: int, I: int, kn: NBitsKnobs) -> int:
    if kind == "gate_up":
        return e * 2 * I + (0 if (row & 15) < 8 else I) + bx * kn.gu_cols + (row >> 4) * 8 + (row & 7)
    return e * H + bx * kn.rows(kind) + row


def _zero_point(Zf: np.ndarray | None, gr: int, b: int, bits: int, zrow: int) -> int:
    """Zero-point of block ``b`` of global weight row ``gr`` (MatMulNBits: int4 packed two per byte, low nibble
    first; int8 one per byte; none stored: the symmetric 2^(bits-1))."""
    if Zf is None:
        return 1 << (bits - 1)
    if bits == 4:
        return (int(Zf[gr * zrow + (b >> 1)]) >> (4 * (b & 1))) & 15
    return int(Zf[gr * zrow + b])


def wt_tiles(kind: str, w: HostExperts, e: int, bx: int, H: int, I: int, kn: NBitsKnobs, dtype: str
             ) -> tuple[np.ndarray, np.ndarray]:
    """(weights [RM, K] float32 as the CTA (bx, expert e) of ``kind`` dequantises them into WT, k tile by k tile,
    read back through the swizzle (NaN where no thread wrote), global rows [RM] of the stacked weight)."""
    rm = kn.rows(kind)
    K = w.K
    bits, bs = w.bits, w.block_size
    nb = K // bs
    zrow = (nb + 1) // 2 if bits == 4 else nb
    prowb = kn.bk * bits // 8
    pcpr = prowb // 16
    cpr = kn.bk // 8
    cb = 8 * bits // 8
    threads = kn.threads
    Bf = w.B.reshape(-1)  # [E_all * R * K * bits / 8] bytes
    Sf = w.scales.reshape(-1)
    Zf = None if w.zp is None else w.zp.reshape(-1)
    prow = K * bits // 8
    kt_n = -(-K // kn.bk)
    tail = K - (kt_n - 1) * kn.bk
    tail_ch, tail_pch = tail >> 3, tail * bits // 128

    # the (scale, 2^23 + zero) table
    sz = np.full((rm * nb, 2), np.nan, np.float32)
    for i in range(rm * nb):
        row, b = i // nb, i % nb
        gr = _global_row(kind, row, e, bx, H, I, kn)
        sz[i] = (Sf[gr * nb + b], np.float32(8388608.0) + np.float32(_zero_point(Zf, gr, b, bits, zrow)))

    # this CTA's packed chunk copies: (stage byte offset, source byte offset, chunk) per (thread, i)
    npc = -(-(rm * pcpr) // threads)
    copies = []
    for tid in range(threads):
        for i in range(npc):
            c = tid + i * threads
            if c >= rm * pcpr:
                continue
            row, ch = c // pcpr, c % pcpr
            copies.append((row * prowb + ch * 16, _global_row(kind, row, e, bx, H, I, kn) * prow + ch * 16, ch))
    ndq = -(-(rm * cpr) // threads)
    out = np.full((rm, K), np.nan, np.float32)
    for kt in range(kt_n):
        stage = np.full(rm * prowb, -1, np.int64)  # -1: a byte no copy of this tile wrote
        nch = tail_pch if kt == kt_n - 1 else pcpr
        for dst, src, ch in copies:
            if ch < nch:
                stage[dst:dst + 16] = Bf[src + kt * prowb:src + kt * prowb + 16]
        wt = np.full((rm, cpr, 8), np.nan, np.float32)  # [row, PHYSICAL chunk, element]
        nchd = tail_ch if kt == kt_n - 1 else cpr
        for tid in range(threads):
            for i in range(ndq):
                c = tid + i * threads
                row, ch = c // cpr, c % cpr
                if not (c < rm * cpr and ch < nchd):
                    continue
                k = kt * kn.bk + ch * 8
                b = k // bs
                s, zf = sz[row * nb + b]
                src = stage[row * prowb + ch * cb:row * prowb + ch * cb + cb]
                assert (src >= 0).all(), "dequantised a byte that was not copied"
                w0 = int.from_bytes(bytes(src[:4].astype(np.uint8)), "little")
                w1 = int.from_bytes(bytes(src[4:8].astype(np.uint8)), "little") if bits == 8 else 0
                v = np.empty(8, np.float32)
                for j in range(8):
                    q = (w0 >> (4 * j)) & 15 if bits == 4 else ((w0 if j < 4 else w1) >> (8 * (j & 3))) & 255
                    v[j] = (np.float32(8388608.0 + q) - zf) * s  # float32 arithmetic, as the kernel
                wt[row, ch ^ (row & 7)] = to_f32(host_bits(v, dtype), dtype)
        # read back as the mma loop's ldmatrix does (logical chunk c at physical c ^ (row & 7)) over the tile's k
        for row in range(rm):
            for ch in range(nchd):
                out[row, kt * kn.bk + ch * 8:kt * kn.bk + ch * 8 + 8] = wt[row, ch ^ (row & 7)]
    rows = np.array([_global_row(kind, r, e, bx, H, I, kn) for r in range(rm)])
    return out, rows


def pchunk(row: int, ch: int, bits: int, kn: NBitsKnobs) -> int:
    """mn_pchunk: the physical 16-byte chunk of packed chunk ``ch`` of staged row ``row`` (reg 1: XOR-swizzled by
    (row / rows per 128 bytes) mod chunks per row; reg 0: unswizzled)."""
    prowb = kn.bk * bits // 8
    return ch ^ ((row // (128 // prowb)) & (prowb // 16 - 1)) if kn.reg else ch


def reg_fragments(kind: str, w: HostExperts, e: int, bx: int, H: int, I: int, kn: NBitsKnobs, dtype: str
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``reg`` 1 path of CTA (bx, expert e) of ``kind``, lane by lane: the packed chunk copies into a ring stage
    (swizzled), the (scale, 2^23 + zero) table laid out [block][row], and every warp's A fragments (a_frag) at each
    of its k16 steps. Returns (weights [RM, K] float32 placed at the logical (row, k) each fragment slot stands for
    in mma.m16n8k16's A layout (NaN where none did), how many fragment slots wrote each (row, k), global rows [RM])."""
    rm = kn.rows(kind)
    K, bits, bs = w.K, w.bits, w.block_size
    nb = K // bs
    zrow = (nb + 1) // 2 if bits == 4 else nb
    prowb = kn.bk * bits // 8
    pcpr = prowb // 16
    Bf, Sf = w.B.reshape(-1), w.scales.reshape(-1)
    Zf = None if w.zp is None else w.zp.reshape(-1)
    prow = K * bits // 8
    kt_n = -(-K // kn.bk)
    tail = K - (kt_n - 1) * kn.bk
    tail_ch, tail_pch = tail >> 3, tail * bits // 128
    spw = kn.bk // 16 // kn.warps

    sz = np.full((nb * rm, 2), np.nan, np.float32)  # s_sz[b * RM + row]
    for i in range(rm * nb):
        row, b = i // nb, i % nb
        gr = _global_row(kind, row, e, bx, H, I, kn)
        sz[b * rm + row] = (Sf[gr * nb + b], np.float32(8388608.0) + np.float32(_zero_point(Zf, gr, b, bits, zrow)))

    out = np.full((rm, K), np.nan, np.float32)
    cnt = np.zeros((rm, K), np.int64)
    for kt in range(kt_n):
        stage = np.full(rm * prowb, -1, np.int64)
        nch = tail_pch if kt == kt_n - 1 else pcpr
        for c in range(rm * pcpr):  # load_w: chunk c = (row c / pcpr, chunk c % pcpr), any thread
            row, ch = c // pcpr, c % pcpr
            if ch < nch:
                dst = row * prowb + pchunk(row, ch, bits, kn) * 16
                src = _global_row(kind, row, e, bx, H, I, kn) * prow + kt * prowb + ch * 16
                assert (stage[dst:dst + 16] < 0).all(), "two copies to one stage byte"
                stage[dst:dst + 16] = Bf[src:src + 16]
        nsteps = (tail_ch if kt == kt_n - 1 else kn.bk // 8) >> 1
        for warp in range(kn.warps):
            for ss in range(spw):
                ks = warp * spw + ss
                if ks >= nsteps:
                    break
                k16 = kt * kn.bk + ks * 16
                blk = k16 // bs
                for lane in range(32):
                    fg, ft = lane >> 2, lane & 3
                    for mt in range(rm // 16):
                        for h in range(2):
                            row = mt * 16 + fg + 8 * h
                            s, zf = sz[blk * rm + row]
                            if bits == 4:
                                off = row * prowb + (pchunk(row, ks >> 1, bits, kn) << 4) + ((ks & 1) << 3)
                                byts = stage[off:off + 8]
                                assert (byts >= 0).all(), "read a stage byte no copy wrote"
                                wx = int.from_bytes(bytes(byts[:4].astype(np.uint8)), "little")
                                wy = int.from_bytes(bytes(byts[4:].astype(np.uint8)), "little")
                                sh = 8 * ft
                                q = [(wx >> sh) & 15, (wx >> (sh + 4)) & 15, (wy >> sh) & 15, (wy >> (sh + 4)) & 15]
                            else:
                                off = row * prowb + (pchunk(row, ks, bits, kn) << 4) + 4 * (ft >> 1)
                                w0b, w1b = stage[off:off + 4], stage[off + 8:off + 12]
                                assert (w0b >= 0).all() and (w1b >= 0).all(), "read a stage byte no copy wrote"
                                w0 = int.from_bytes(bytes(w0b.astype(np.uint8)), "little")
                                w1 = int.from_bytes(bytes(w1b.astype(np.uint8)), "little")
                                sh = 16 * (ft & 1)
                                q = [(w0 >> sh) & 255, (w0 >> (sh + 8)) & 255, (w1 >> sh) & 255,
                                     (w1 >> (sh + 8)) & 255]
                            v = np.array([(np.float32(8388608.0 + qq) - zf) * s for qq in q], np.float32)
                            v = to_f32(host_bits(v, dtype), dtype)
                            # mma.m16n8k16 A (row-major) slots of lane (g, t): a0 (row g, k 2t, 2t+1), a1 (row g+8,
                            # same k), a2 (row g, k 2t+8, 2t+9), a3 (row g+8, same k); lower half = lower k
                            for j, kl in enumerate((2 * ft, 2 * ft + 1, 2 * ft + 8, 2 * ft + 9)):
                                out[row, k16 + kl] = v[j]
                                cnt[row, k16 + kl] += 1
    rows = np.array([_global_row(kind, r, e, bx, H, I, kn) for r in range(rm)])
    return out, cnt, rows
