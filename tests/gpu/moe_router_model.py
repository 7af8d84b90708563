"""A lane-level numpy model of ``ops/cuda/moe_router.cu``'s phase 1 (the router GEMM): which CTA, warp and lane
loads which weights and h elements, the m16n8k16 fragments they form (the PTX ISA's layouts), the shared-memory
reduction over the warps and which logits each CTA writes. The CPU tests check it against ``h @ w.T`` and that
every logit of the step is written exactly once; the GPU tests check the kernel itself."""

from __future__ import annotations

import numpy as np

WARPS, K_BLOCK = 32, 32


_LANE = np.arange(32)
_G, _Q = _LANE >> 2, _LANE & 3
_PAIR = 2 * _Q[:, None] + np.arange(2)  # [32, 2]: the k (A) / k (B) index of each register's two elements


def _frag_a(a0: np.ndarray, a1: np.ndarray, a2: np.ndarray, a3: np.ndarray) -> np.ndarray:
    """The 16 x 16 A operand of one warp's m16n8k16 from its lanes' four registers (``[32, 2]`` element pairs each):
    reg 0 (row g, k 2q..), reg 1 (row g + 8, k 2q..), reg 2 (row g, k 2q + 8..), reg 3 (row g + 8, k 2q + 8..)."""
    a = np.zeros((16, 16))
    rows = _G[:, None]
    a[rows, _PAIR] = a0
    a[rows + 8, _PAIR] = a1
    a[rows, _PAIR + 8] = a2
    a[rows + 8, _PAIR + 8] = a3
    return a


def _frag_b(b0: np.ndarray, b1: np.ndarray) -> np.ndarray:
    """The 16 x 8 (k x n) B operand: reg 0 (k 2q.., column g), reg 1 (k 2q + 8.., column g)."""
    b = np.zeros((16, 8))
    cols = _G[:, None]
    b[_PAIR, cols] = b0
    b[_PAIR + 8, cols] = b1
    return b


def phase1(h: np.ndarray, w: np.ndarray, n: int, rows_per_cta: int, ld: int | None = None
           ) -> tuple[np.ndarray, np.ndarray]:
    """(logits [n, ld] float64, writes [n, ld] int: how many times each element was written) as the kernel's
    grid computes them: h [>= n, H], w [E_pad, H] (float values of the bf16/fp16 operands)."""
    e_pad, H = w.shape
    ld = e_pad if ld is None else ld
    tiles = -(-rows_per_cta // 8)
    nkb = H // K_BLOCK
    out = np.zeros((n, ld))
    writes = np.zeros((n, ld), np.int64)
    g, q = _G, _Q
    for cta in range(-(-e_pad // rows_per_cta)):
        row0 = cta * rows_per_cta
        red = np.zeros((WARPS, tiles, 128))
        for warp in range(WARPS):
            acc = np.zeros((tiles, 16, 8))  # D as the tile's matrix (fragments: rows g / g + 8, columns 2q, 2q + 1)
            for b in range(warp, nkb, WARPS):
                cols = b * K_BLOCK + 8 * q[:, None] + np.arange(8)  # [32 lanes, 8]: each lane's 16-byte chunk
                ha = np.where((g < n)[:, None], h[np.minimum(g, len(h) - 1)[:, None], cols], 0.0)
                hb = np.where((g + 8 < n)[:, None], h[np.minimum(g + 8, len(h) - 1)[:, None], cols], 0.0)
                for j in range(tiles):
                    r = 8 * j + g
                    ok = (r < rows_per_cta) & (row0 + r < e_pad)
                    wr = np.where(ok[:, None], w[np.minimum(row0 + r, e_pad - 1)[:, None], cols], 0.0)
                    # step 1: a = (ha.x, hb.x, ha.y, hb.y), b = (wr.x, wr.y); step 2: the .z / .w halves
                    for s in (0, 4):
                        a = _frag_a(ha[:, s:s + 2], hb[:, s:s + 2], ha[:, s + 2:s + 4], hb[:, s + 2:s + 4])
                        acc[j] += a @ _frag_b(wr[:, s:s + 2], wr[:, s + 2:s + 4])
            # red[warp][tile][t * 8 + r]: lane (g, q) stores (c0, c1) at g * 8 + 2q, (c2, c3) at (g + 8) * 8 + 2q
            for j in range(tiles):
                c01, c23 = acc[j, _G[:, None], _PAIR], acc[j, _G[:, None] + 8, _PAIR]  # the lanes' registers
                red[warp, j, _G[:, None] * 8 + _PAIR] = c01
                red[warp, j, (_G[:, None] + 8) * 8 + _PAIR] = c23
        for tid in range(tiles * 128):  # the summing threads
            j, e = tid >> 7, tid & 127
            t, r = e >> 3, 8 * j + (e & 7)
            row = row0 + r
            if t < n and r < rows_per_cta and row < e_pad:
                out[t, row] = red[:, j, e].sum()
                writes[t, row] += 1
    return out, writes


def phase2_copy(n: int, num_experts: int, fold_shared: bool, ld: int) -> np.ndarray:
    """Flat logits offsets ``t * ld + e`` the last CTA copies into shared memory, in shared-memory order."""
    ew = num_experts + int(fold_shared)
    i = np.arange(n * ew)
    return (i // ew) * ld + i % ew
