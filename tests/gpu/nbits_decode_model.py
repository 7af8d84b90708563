"""A numpy model of ``ops/cuda/nbits_decode.cu`` lane by lane, and an independent packer / dequantiser of the
MatMulNBits operand written from its format description (not the project's code), for the CPU tests of the int4 /
int8 decode GEMM (test_nbits_decode_compile.py) and the GPU tests' references (test_nbits_decode_gpu.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Packed:
    """One quantized linear in the device layout: B uint8 [N, K * bits / 8], scales float32 [N, nb], zp uint8
    packed or None, perm int32 [K] or None (k_in = the zero column)."""

    B: np.ndarray
    scales: np.ndarray
    zp: np.ndarray | None
    perm: np.ndarray | None
    K: int
    N: int
    bits: int
    bs: int
    k_in: int


def random_packed(rng: np.random.Generator, N: int, K: int, bits: int, bs: int, asym: bool, k_in: int | None = None,
                  scale: float = 0.01) -> Packed:
    """Random codes, float16-valued positive scales, zero-points (asym) and, when ``k_in`` is given, a random
    permutation of the k_in input columns plus K - k_in padding columns (reading the zero column k_in)."""
    nb = K // bs
    q = rng.integers(0, 1 << bits, (N, K), dtype=np.uint8)
    if bits == 4:
        B = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    else:
        B = q.copy()
    scales = (rng.uniform(0.5, 1.5, (N, nb)) * scale).astype(np.float16).astype(np.float32)
    zp = None
    if asym:
        z = rng.integers(0, 1 << bits, (N, nb), dtype=np.uint8)
        if bits == 4:
            zz = np.concatenate([z, np.zeros((N, nb % 2), np.uint8)], axis=1)
            zp = (zz[:, 0::2] | (zz[:, 1::2] << 4)).astype(np.uint8)
        else:
            zp = z
    perm = None
    if k_in is not None:
        assert k_in <= K
        perm = np.concatenate([rng.permutation(k_in), np.full(K - k_in, k_in)]).astype(np.int32)
        perm = perm[rng.permutation(K)]  # padding columns anywhere
    return Packed(B, scales, zp, perm, K, N, bits, bs, K if k_in is None else k_in)


def dequantize_op(p: Packed, scales: np.ndarray | None = None) -> np.ndarray:
    """float64 [N, K]: w[n, k] = (q[n, k] - z[n, k // bs]) * s[n, k // bs], in op column order (``scales``: other
    scales [N, nb] instead of the operand's)."""
    N, K, bs = p.N, p.K, p.bs
    nb = K // bs
    if p.bits == 4:
        q = np.empty((N, K), np.int64)
        q[:, 0::2] = p.B & 0x0F
        q[:, 1::2] = p.B >> 4
    else:
        q = p.B.astype(np.int64)
    if p.zp is None:
        z = np.full((N, nb), 1 << (p.bits - 1), np.int64)
    elif p.bits == 4:
        z = np.empty((N, 2 * p.zp.shape[1]), np.int64)
        z[:, 0::2] = p.zp & 0x0F
        z[:, 1::2] = p.zp >> 4
        z = z[:, :nb]
    else:
        z = p.zp.astype(np.int64)
    blk = np.arange(K) // bs
    s = p.scales if scales is None else scales
    return (q - z[:, blk]) * np.asarray(s, np.float64)[:, blk]


def x_op(p: Packed, x: np.ndarray) -> np.ndarray:
    """[n, K]: the input columns the op reads (x [n, >= k_in]); the padding column reads 0."""
    if p.perm is None:
        return x[:, :p.K]
    xz = np.concatenate([x[:, :p.k_in], np.zeros((x.shape[0], 1), x.dtype)], axis=1)
    return xz[:, p.perm]


# ---------------------------------------------------------------------------------------- the kernel, lane by lane


def prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode, selectors 0..7): result byte i = byte sel[i] of {b, a}."""
    src = [(a >> (8 * i)) & 255 for i in range(4)] + [(b >> (8 * i)) & 255 for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def mma16816(a: list, b: list) -> np.ndarray:
    """D (16 x 8) of one mma.sync m16n8k16 from the 32 lanes' fragments (PTX ISA layouts): lane (g, t) holds
    a0 = A[g, 2t:2t+2], a1 = A[g+8, 2t:2t+2], a2 = A[g, 2t+8:2t+10], a3 = A[g+8, 2t+8:2t+10] and
    b0 = B[2t:2t+2, g], b1 = B[2t+8:2t+10, g]; a pair is (lower half, upper half)."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a0, a1, a2, a3 = a[lane]
        b0, b1 = b[lane]
        A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = a0, a1
        A[g, 2 * t + 8:2 * t + 10], A[g + 8, 2 * t + 8:2 * t + 10] = a2, a3
        B[2 * t:2 * t + 2, g], B[2 * t + 8:2 * t + 10, g] = b0, b1
    return A @ B


def block_of(k: int, bs: int) -> int:
    sh = bs.bit_length() - 1 if bs & (bs - 1) == 0 else -1
    return k >> sh if sh >= 0 else k // bs


def load_chunk(p: Packed, r: int, c: int, ok: bool, halves: int | None = None) -> tuple[list[int], list[float],
                                                                                          list[int]]:
    """The kernel's ``load_chunk``: the chunk's 4 little-endian words, and per half the scale and zero-point
    (``halves``: NB_HALVES, default 2 for 4-bit and 1 for 8-bit; the sacc build loads one per chunk)."""
    cc = 128 // p.bits
    halves = (2 if p.bits == 4 else 1) if halves is None else halves
    if not ok:
        return [0, 0, 0, 0], [0.0] * halves, [0] * halves
    raw = p.B[r, 16 * c:16 * c + 16]
    words = [int.from_bytes(bytes(raw[4 * i:4 * i + 4]), "little") for i in range(4)]
    nb = p.K // p.bs
    s, z = [], []
    for h in range(halves):
        b = block_of(c * cc + h * (cc // 2), p.bs)
        s.append(float(p.scales[r, b]))
        if p.zp is None:
            z.append(1 << (p.bits - 1))
        elif p.bits == 4:
            assert p.zp.shape[1] == (nb + 1) >> 1
            z.append((int(p.zp[r, b >> 1]) >> (4 * (b & 1))) & 15)
        else:
            z.append(int(p.zp[r, b]))
    return words, s, z


def dequant_word(words: list[int], s: list[float], z: list[int], wi: int, bits: int) -> list[tuple[float, float]]:
    """The kernel's ``dequant_word`` (exact path, in float64): the word's T pairs (lower, upper). With a single
    (scale, zero) per chunk (``len(s) == 1``: the sacc build's NB_HALVES 1) every word takes it."""
    w = words[wi]
    h = (wi >> 1) if bits == 4 and len(s) == 2 else 0
    if bits == 4:
        return [(((w >> (4 * p)) & 15) - z[h]) * s[h] for p in range(4)], \
            [(((w >> (4 * p + 16)) & 15) - z[h]) * s[h] for p in range(4)]
    return [(((w >> (16 * p)) & 255) - z[h]) * s[h] for p in range(2)], \
        [(((w >> (16 * p + 8)) & 255) - z[h]) * s[h] for p in range(2)]


def pairs(lo: list[float], hi: list[float]) -> list[tuple[float, float]]:
    return list(zip(lo, hi, strict=True))


def x_word(xo: np.ndarray, j: int, k0: int, ok: bool, bits: int) -> list[tuple[float, float]]:
    """The kernel's ``x_chunk`` + ``x_pairs`` for one word: X pairs of op columns k0 .. k0 + codes-per-word - 1 of
    row j. The 16-bit lanes carry the column's index + 1 (0 = a zero), so that the real prmt selectors are
    exercised; values are looked up after."""
    cw = 32 // bits
    v = [0] * (cw // 2)
    if ok:
        for e in range(cw):
            v[e >> 1] |= (k0 + e + 1) << (16 * (e & 1))
    if bits == 4:
        xp = [prmt(v[0], v[2], 0x5410), prmt(v[0], v[2], 0x7632), prmt(v[1], v[3], 0x5410), prmt(v[1], v[3], 0x7632)]
    else:
        xp = v

    def val(ix: int) -> float:
        return 0.0 if ix == 0 else float(xo[j, ix - 1])

    return [(val(u & 0xFFFF), val(u >> 16)) for u in xp]


def cta_model(p: Packed, xo: np.ndarray, n: int, row0: int, mt_count: int, nw: int, sacc: bool = False) -> np.ndarray:
    """out rows [row0, row0 + 16 mt_count) x tokens [0, 16) of one CTA as nbits_decode.cu computes them, with
    exact (float64) weights (NaN where it writes nothing); xo: [16, K] the op-order input (x_op). ``sacc``: the
    NB_SACC build (4-bit): the MMAs on q - z into a per-super-step partial, each output element's partial then
    scaled by the scale THE LANE HOLDING IT loaded (its own chunk's: right only where the super-step's 4 chunks
    share one block)."""
    N, K, bits = p.N, p.K, p.bits
    cc = 128 // bits
    C = K // cc
    S = (C + 3) // 4
    npairs = 16 // bits
    ng = (n + 7) // 8
    red = np.zeros((nw, mt_count, 2, 16, 8))
    for w in range(nw):
        s0, s1 = S * w // nw, S * (w + 1) // nw
        for s in range(s0, s1):
            chunks = {}
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                c = 4 * s + t
                for mt in range(mt_count):
                    for h in range(2):
                        r = min(row0 + 16 * mt + g + 8 * h, N - 1)
                        chunks[lane, mt, h] = load_chunk(p, r, c, c < C, 1 if sacc else None)
            part = np.zeros((mt_count, 2, 16, 8))
            for wi in range(4):
                xs, ws = {}, {}
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    c = 4 * s + t
                    k0 = c * cc + wi * (cc // 4)
                    for q in range(2):
                        j = 8 * q + g
                        xs[lane, q] = x_word(xo, j, k0, c < C and q < ng and j < n, bits)
                    for mt in range(mt_count):
                        for h in range(2):
                            words, sc, zz = chunks[lane, mt, h]
                            ws[lane, mt, h] = pairs(*dequant_word(words, [1.0] if sacc else sc, zz, wi, bits))
                for mt in range(mt_count):
                    for q in range(ng):
                        for m in range(npairs // 2):
                            a = [(ws[la, mt, 0][2 * m], ws[la, mt, 1][2 * m], ws[la, mt, 0][2 * m + 1],
                                  ws[la, mt, 1][2 * m + 1]) for la in range(32)]
                            b = [(xs[la, q][2 * m], xs[la, q][2 * m + 1]) for la in range(32)]
                            part[mt, q] += mma16816(a, b)
            if sacc:  # fragment (row r, column col) lives in lane (r % 8, col // 2): its chunk's scale of row r
                for mt in range(mt_count):
                    for r in range(16):
                        for col in range(8):
                            part[mt, :, r, col] *= chunks[4 * (r % 8) + col // 2, mt, r // 8][1][0]
            red[w] += part
    tot = red.sum(0)
    out = np.full((16 * mt_count, 16), np.nan)
    for mt in range(mt_count):
        for q in range(ng):
            for r in range(16):
                for c in range(8):
                    j, row = 8 * q + c, row0 + 16 * mt + r
                    if j < n and row < N:
                        out[16 * mt + r, j] = tot[mt, q, r, c]
    return out
