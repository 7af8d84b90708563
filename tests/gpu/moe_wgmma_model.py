"""A lane-level numpy model of ``ops/cuda/moe_wgmma.cu`` (no GPU): the cp.async chunk mapping into the
1024-byte-aligned, 128B-swizzled stage ring, the matrix descriptors the kernel builds, the PTX ISA's canonical
K-major SW128 layout those descriptors declare (what wgmma reads), the wgmma m64nNk16 accumulator fragment and
the epilogues' row/column mapping, and the ring's schedule (which stage each copy and each MMA touches, and
when). The kernel's layout constants are read from its source, and every index expression is transcribed from
it, so a slip there shows up here as a wrong product on a CPU."""

from __future__ import annotations

import re

import numpy as np

from hybrid_runtime.cuda.kernels import source

ROWB = 128  # bytes per shared row (64 x 16-bit)


def cu_defines() -> dict[str, int]:
    """The integer ``#define``s of moe_wgmma.cu (defaults of the -D options included)."""
    out = {}
    for name, val in re.findall(r"^\s*#define (WG_\w+) (\d+)\b", source("moe_wgmma.cu"), re.M):
        out.setdefault(name, int(val))
    return out


# ------------------------------------------------------------------------ the kernel's address math


def wg_off(row: int, c: int) -> int:
    """moe_wgmma.cu's wg_off: byte offset of 16-byte chunk c of row `row` in an operand tile."""
    return row * ROWB + ((c ^ (row & 7)) << 4)


def wg_desc(saddr: int, d: dict[str, int]) -> int:
    """moe_wgmma.cu's wg_desc."""
    return (((saddr & 0x3FFFF) >> 4) | ((d["WG_LBO"] >> 4) << 16) | ((d["WG_SBO"] >> 4) << 32)
            | (d["WG_SWIZZLE_128B"] << 62))


# ------------------------------------------------------------------------ the PTX ISA's side


def canonical_k_major_address(desc: int, row: int | np.ndarray, k: int | np.ndarray) -> int | np.ndarray:
    """Shared byte address wgmma reads element (row, k) of a K-major 16-bit operand at (k < 16 inside one k16
    instruction), from the descriptor's fields as the PTX ISA defines them (matrix-descriptor format; canonical
    layouts): start address = bits 0-13 << 4, SBO = bits 32-45 << 4 (from one 8-row core-matrix group to the
    next), base offset bits 49-51, layout type bits 62-63 (1 = 128-byte swizzle). In the 128B-swizzle K-major
    layout, the 8 rows of a group are 128 bytes apart (T = 64 elements of 16 bits per row) and the address's
    16-byte chunk bits [4, 7) are XORed with its bits [7, 10) (the swizzle repeats every 1024 bytes, which is why
    the atoms must be 1024-aligned with base offset 0). LBO is unused for this layout when the k extent of the
    instruction (32 bytes) stays inside one 128-byte row."""
    start = (desc & 0x3FFF) << 4
    sbo = ((desc >> 32) & 0x3FFF) << 4
    base_off = (desc >> 49) & 7
    mode = desc >> 62
    assert mode == 1 and base_off == 0, (mode, base_off)
    assert np.all((np.asarray(k) >= 0) & (np.asarray(k) < 16))
    lin = start + (row // 8) * sbo + (row % 8) * 128 + 2 * k
    return lin ^ (((lin >> 7) & 7) << 4)


def accumulator_position(lane_in_wg: int, i: int) -> tuple[int, int]:
    """(row, column) of accumulator register i of thread `lane_in_wg` (0..127) of a warpgroup, in its m64nN
    float32 D (PTX ISA wgmma D fragment: warp w rows 16 w .. 16 w + 15; row lane/4 (+8 for i % 4 >= 2),
    column 8 (i / 4) + 2 (lane % 4) + i % 2)."""
    w, lane = lane_in_wg // 32, lane_in_wg % 32
    return 16 * w + lane // 4 + 8 * ((i // 2) % 2), 8 * (i // 4) + 2 * (lane % 4) + (i % 2)


# ------------------------------------------------------------------------ one CTA


def wgmma_cta_model(mode: str, A: np.ndarray, lda: int, W: np.ndarray, K: int, I: int, H: int, kk: int, ny: int,
                    tile: tuple[int, int, int], pair_list: np.ndarray, pair_w: np.ndarray | None, bx: int,
                    out: np.ndarray, bn: int = 256, stages: int = 4, sbase: int = 0x1400) -> None:
    """CTA (bx, tile) of moe_wgmma_gate_up / moe_wgmma_down into ``out`` (flat act [pairs*I] or y [n*ny*H]).
    ``sbase``: the shared address of the (aligned) ring; shared memory is an element array indexed by byte
    address / 2, written by the modelled cp.async copies and read through the descriptors."""
    d = cu_defines()
    BM, BK, THREADS = d["WG_BM"], d["WG_BK"], d["WG_THREADS"]
    assert sbase % 1024 == 0
    a_bytes, b_bytes = BM * ROWB, bn * ROWB
    stage_bytes = a_bytes + b_bytes
    smem = np.full((sbase + stages * stage_bytes) // 2, np.nan)
    e, start, rows = tile
    s_pair = [int(pair_list[start + r]) if r < rows else -1 for r in range(BM)]
    s_src = [-1 if p < 0 else ((p // kk) * lda if mode == "gate_up" else p * lda) for p in s_pair]

    def load_stage(stage: int, kt: int) -> None:
        sA = sbase + stage * stage_bytes
        sB = sA + a_bytes
        k0 = kt * BK
        for tid in range(THREADS):
            ch, r0 = tid & 7, tid >> 3
            for i in range(BM // 32):
                row = r0 + 32 * i
                src = s_src[row]
                dst = (sA + wg_off(row, ch)) // 2
                smem[dst:dst + 8] = 0.0 if src < 0 else A[src + k0 + ch * 8:src + k0 + ch * 8 + 8]
            for i in range(bn // 32):
                row = r0 + 32 * i
                if mode == "gate_up":
                    wb = e * 2 * I * K + (bx * (bn // 2) + r0) * K + ch * 8
                    up = (I - bn // 2) * K if i >= bn // 64 else 0
                else:
                    wb = e * H * K + (bx * bn + r0) * K + ch * 8
                    up = 0
                src = wb + 32 * i * K + up + k0
                dst = (sB + wg_off(row, ch)) // 2
                smem[dst:dst + 8] = W[src:src + 8]

    acc = np.zeros((2, 64, bn))  # per warpgroup, D as wgmma holds it
    for kt in range(K // BK):
        stage = kt % stages
        load_stage(stage, kt)  # the ring's timing is checked by ring_schedule; here each tile lands first
        sA = sbase + stage * stage_bytes
        for wg in range(2):
            da, db = wg_desc(sA + wg * 64 * ROWB, d), wg_desc(sA + a_bytes, d)
            for s in range(BK // 16):
                k16 = np.arange(16)[None, :]
                a = smem[canonical_k_major_address(da + 2 * s, np.arange(64)[:, None], k16) // 2]
                b = smem[canonical_k_major_address(db + 2 * s, np.arange(bn)[:, None], k16) // 2]
                acc[wg] += a @ b.T
    nj = bn // 8
    for tid in range(THREADS):
        wg, lt = tid >> 7, tid & 127
        regs = [acc[wg][accumulator_position(lt, i)] for i in range(bn // 2)]
        wq, lane = (tid >> 5) & 3, tid & 31
        g, t4 = lane >> 2, lane & 3
        for hi in range(2):
            r = wg * 64 + wq * 16 + g + hi * 8
            if r >= rows:
                continue
            p = s_pair[r]
            if mode == "gate_up":
                dst = p * I + bx * (bn // 2) + 2 * t4
                for j in range(nj // 2):
                    for b in range(2):
                        x, u = regs[4 * j + 2 * hi + b], regs[4 * (j + nj // 2) + 2 * hi + b]
                        out[dst + j * 8 + b] = x / (1 + np.exp(-x)) * u
            else:
                t, slot = p // kk, p % kk
                assert pair_w is not None
                dst = (t * ny + slot) * H + bx * bn + 2 * t4
                for j in range(nj):
                    for b in range(2):
                        out[dst + j * 8 + b] = pair_w[p] * regs[4 * j + 2 * hi + b]


def ring_schedule(kt_count: int, stages: int, inflight: int) -> list[tuple[str, int, int, int]]:
    """The main loop's events in program order, (what, k tile, stage, iteration): "land" (a thread's
    cp.async.wait_group returned with tile kt in place), "copy" (copies of tile kt into a stage issued),
    "mma" (wgmmas of tile kt on a stage issued), "done" (a wgmma.wait_group guarantees tile kt's wgmmas
    completed). Transcribed from the kernel's loop (lead = stages - 1 - inflight tiles copied ahead)."""
    lead = stages - 1 - inflight
    ev: list[tuple[str, int, int, int]] = []
    committed: list[int] = []  # k tile per commit group (-1: empty)
    for s in range(lead):
        if s < kt_count:
            ev.append(("copy", s, s % stages, -1))
        committed.append(s if s < kt_count else -1)
    mma_groups: list[int] = []
    for kt in range(kt_count):
        # cp.async.wait_group(lead - 1): every group but the newest lead - 1 complete
        for t in committed[:len(committed) - (lead - 1)]:
            if t >= 0 and ("land", t, t % stages, kt) not in ev and not any(x[0] == "land" and x[1] == t for x in ev):
                ev.append(("land", t, t % stages, kt))
        nk = kt + lead
        if nk < kt_count:
            ev.append(("copy", nk, nk % stages, kt))
        committed.append(nk if nk < kt_count else -1)
        ev.append(("mma", kt, kt % stages, kt))
        mma_groups.append(kt)
        for t in mma_groups[:len(mma_groups) - inflight]:
            if not any(x[0] == "done" and x[1] == t for x in ev):
                ev.append(("done", t, t % stages, kt))
    return ev
