"""A lane-level numpy model of ``ops/cuda/moe_wgmma.cu`` (no GPU): the cp.async chunk mapping into the
1024-byte-aligned, 128B-swizzled stage ring, the matrix descriptors the kernel builds, the PTX ISA's canonical
K-major SW128 layout those descriptors declare (what wgmma reads), the wgmma m64nNk16 accumulator fragment and
the epilogues' row/column mapping, and the ring's schedule (which stage each copy and each MMA touches, and
when). The kernel's layout constants are read from its source, and every index expression is transcribed from
it, so a slip there shows up here as a wrong product on a CPU."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

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
                    out: np.ndarray, bn: int = 256, stages: int = 4, sbase: int = 0x1400, bm: int = 128) -> None:
    """CTA (bx, tile) of moe_wgmma_gate_up / moe_wgmma_down into ``out`` (flat act [pairs*I] or y [n*ny*H]).
    ``sbase``: the shared address of the (aligned) ring; shared memory is an element array indexed by byte
    address / 2, written by the modelled cp.async copies and read through the descriptors. ``bm``: the build's
    WG_BM (128: two warpgroups; 64: one), WG_THREADS = 2 bm threads, each copy pass WG_RPP = threads / 8 rows."""
    d = cu_defines()
    BM, BK, THREADS = bm, d["WG_BK"], 2 * bm
    RPP, WGS = THREADS // 8, bm // 64
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
            for i in range(BM // RPP):
                row = r0 + RPP * i
                src = s_src[row]
                dst = (sA + wg_off(row, ch)) // 2
                smem[dst:dst + 8] = 0.0 if src < 0 else A[src + k0 + ch * 8:src + k0 + ch * 8 + 8]
            for i in range(bn // RPP):
                row = r0 + RPP * i
                if mode == "gate_up":
                    wb = e * 2 * I * K + (bx * (bn // 2) + r0) * K + ch * 8
                    up = (I - bn // 2) * K if RPP * i >= bn // 2 else 0
                else:
                    wb = e * H * K + (bx * bn + r0) * K + ch * 8
                    up = 0
                src = wb + RPP * i * K + up + k0
                dst = (sB + wg_off(row, ch)) // 2
                smem[dst:dst + 8] = W[src:src + 8]

    acc = np.zeros((WGS, 64, bn))  # per warpgroup, D as wgmma holds it
    for kt in range(K // BK):
        stage = kt % stages
        load_stage(stage, kt)  # the ring's timing is checked by ring_schedule; here each tile lands first
        sA = sbase + stage * stage_bytes
        for wg in range(WGS):
            da, db = wg_desc(sA + wg * 64 * ROWB, d), wg_desc(sA + a_bytes, d)
            for s in range(BK // 16):
                k16 = np.arange(16)[None, :]
                a = smem[canonical_k_major_address(da + 2 * s, np.arange(64)[:, None], k16) // 2]
                b = smem[canonical_k_major_address(db + 2 * s, np.arange(bn)[:, None], k16) // 2]
                acc[wg] += a @ b.T
    for tid in range(THREADS):
        wg, lt = tid >> 7, tid & 127
        regs = [acc[wg][accumulator_position(lt, i)] for i in range(bn // 2)]
        store_fragment_rows(mode, regs, tid, rows, lambda r: int(s_pair[r]), I, H, kk, ny, bn, bx, pair_w, out)


def store_fragment_rows(mode: str, regs: list[float], tid: int, rows: int, pair_of_row: Callable[[int], int],
                        I: int, H: int, kk: int, ny: int, bn: int, bx: int, pair_w: np.ndarray | None,
                        out: np.ndarray) -> None:
    """The epilogue stored straight from consumer thread ``tid``'s accumulator fragment ``regs`` (moe_wgmma.cu;
    moe_wgmma_ws.cu's float32 slots and ``-DWS_STAGED_EPI=0``): its rows 16 wq + g8 (+ 8) of its warpgroup's 64
    below ``rows``, pair ``pair_of_row(r)``; gate_up writes SwiGLU of its gate / up columns to act, down
    ``pair_w * acc`` to the pair's y slot, column block ``bx`` of ``bn``."""
    nj = bn // 8
    wg, wq, lane = tid >> 7, (tid >> 5) & 3, tid & 31
    g8, t4 = lane >> 2, lane & 3
    for hi in range(2):
        r = wg * 64 + wq * 16 + g8 + hi * 8
        if r >= rows:
            continue
        p = pair_of_row(r)
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


# ------------------------------------------------------------------------ moe_wgmma_ws.cu (impl "wgmma_ws")


def ws_defines() -> dict[str, int]:
    """The integer ``#define``s of moe_wgmma_ws.cu (defaults of the -D options included)."""
    out = {}
    for name, val in re.findall(r"^\s*#define (WS_\w+) \(?(\d+)", source("moe_wgmma_ws.cu"), re.M):
        out.setdefault(name, int(val))
    return out


def ws_items(n_tiles: int, nx: int, grid: int) -> list[list[tuple[int, int]]]:
    """Per CTA b of the persistent grid, its work items (tile, x) in order: items b, b + grid, ... < n_tiles * nx,
    item = tile * nx + x (moe_wgmma_ws.cu's loops, producer and consumers alike)."""
    out = []
    for b in range(grid):
        out.append([(item // nx, item - (item // nx) * nx) for item in range(b, n_tiles * nx, grid)])
    return out


def ws_load_stage(smem: np.ndarray, mode: str, A: np.ndarray, lda: int, W: np.ndarray, K: int, I: int, H: int,
                  kk: int, tile: tuple[int, int, int], pair_list: np.ndarray, x: int, sA: int, kt: int) -> None:
    """The producer warpgroup's copies of one stage (k tile kt of work item (tile, x)) into ``smem`` (an element
    array indexed by byte address / 2): moe_wgmma_ws.cu's producer loop, thread by thread."""
    d = ws_defines()
    BM, BN, BK, PR = d["WS_BM"], d["WS_BN"], d["WS_BK"], d["WS_PROD_ROWS"]
    sB = sA + BM * ROWB
    e, start, rows = tile
    k0 = kt * BK
    for ptid in range(d["WS_PRODUCERS"]):
        ch, r0 = ptid & 7, ptid >> 3
        for i in range(BM // PR):
            row = r0 + PR * i
            p = int(pair_list[start + row]) if row < rows else -1
            dst = (sA + wg_off(row, ch)) // 2
            if p < 0:
                smem[dst:dst + 8] = 0.0
            else:
                src = ((p // kk) * lda if mode == "gate_up" else p * lda) + ch * 8 + k0
                smem[dst:dst + 8] = A[src:src + 8]
        if mode == "gate_up":
            wb = e * 2 * I * K + (x * (BN // 2) + r0) * K + ch * 8
            up_jump = (I - BN // 2) * K
        else:
            wb = e * H * K + (x * BN + r0) * K + ch * 8
            up_jump = 0
        for i in range(BN // PR):
            row = r0 + PR * i
            src = wb + PR * i * K + (up_jump if i >= BN // (2 * PR) else 0) + k0
            dst = (sB + wg_off(row, ch)) // 2
            smem[dst:dst + 8] = W[src:src + 8]


def ws_cta_model(mode: str, A: np.ndarray, lda: int, W: np.ndarray, K: int, I: int, H: int, kk: int, ny: int,
                 tile_list: list[tuple[int, int, int]], pair_list: np.ndarray, pair_w: np.ndarray | None,
                 items: list[tuple[int, int]], out: np.ndarray, sbase: int = 0x1400, staged: bool | None = None,
                 y_in_t: bool = True) -> None:
    """One persistent CTA of moe_wgmma_ws.cu running ``items`` (tile index, x) in order: the producer's copies
    (:func:`ws_load_stage`) into stage g % S of the ring, the consumers' descriptor reads (each warpgroup its 64
    rows, the k16 steps), the accumulator fragment and the epilogue (pair ids from pair_list): stores straight
    from the accumulators, or with ``staged`` (default: the source's WS_STAGED_EPI) through shared memory for
    gate_up and for down into the bundle dtype (``y_in_t``; :func:`ws_staged_epilogue`)."""
    d = ws_defines()
    BM, BN, BK, S = d["WS_BM"], d["WS_BN"], d["WS_BK"], d["WS_STAGES"]
    wd = {"WG_LBO": d["WS_LBO"], "WG_SBO": d["WS_SBO"], "WG_SWIZZLE_128B": d["WS_SWIZZLE_128B"]}
    assert sbase % 1024 == 0
    stage_bytes = (BM + BN) * ROWB
    smem = np.full((sbase + S * stage_bytes) // 2, np.nan)
    g = 0
    for ti, x in items:
        _, start, rows = tile_list[ti]
        acc = np.zeros((2, 64, BN))
        for kt in range(K // BK):
            sA = sbase + (g % S) * stage_bytes
            ws_load_stage(smem, mode, A, lda, W, K, I, H, kk, tile_list[ti], pair_list, x, sA, kt)
            for wg in range(2):
                da, db = wg_desc(sA + wg * 64 * ROWB, wd), wg_desc(sA + BM * ROWB, wd)
                for s in range(BK // 16):
                    k16 = np.arange(16)[None, :]
                    a = smem[canonical_k_major_address(da + 2 * s, np.arange(64)[:, None], k16) // 2]
                    b = smem[canonical_k_major_address(db + 2 * s, np.arange(BN)[:, None], k16) // 2]
                    acc[wg] += a @ b.T
            g += 1
        regs_of = {}
        for tid in range(d["WS_CONSUMERS"]):
            wg, lt = tid >> 7, tid & 127
            regs_of[tid] = [acc[wg][accumulator_position(lt, i)] for i in range(BN // 2)]
        if (d["WS_STAGED_EPI"] if staged is None else staged) and (mode == "gate_up" or y_in_t):
            ws_staged_epilogue(mode, regs_of, I, H, kk, ny, start, rows, pair_list, pair_w, x, out)
            continue
        for tid in range(d["WS_CONSUMERS"]):
            store_fragment_rows(mode, regs_of[tid], tid, rows, lambda r, s0=start: int(pair_list[s0 + r]), I, H, kk,
                                ny, BN, x, pair_w, out)


def ws_staged_epilogue(mode: str, regs_of: dict[int, list[float]], I: int, H: int, kk: int, ny: int, start: int,
                       rows: int, pair_list: np.ndarray, pair_w: np.ndarray | None, x: int, out: np.ndarray) -> None:
    """moe_wgmma_ws.cu's staged epilogue (gate_up, and down into the bundle dtype), lane by lane: each pass the
    consumers write their fragments (2 values per 32-bit word) at byte ``row * WS_EPI_ROWB + 2 * column`` of the
    held stage, then thread ``tid`` copies the 16-byte chunk tid & 15 of rows (tid >> 4) + 16 i to the pair's row
    (the ``-DWS_STAGED_EPI=1`` build). Asserts that every warp's fragment write touches 32 different banks, that
    the copy reads only bytes this pass wrote, and that the buffer fits one stage."""
    d = ws_defines()
    BN, ROWB_E, NC = d["WS_BN"], d["WS_EPI_ROWB"], d["WS_CONSUMERS"]
    assert d["WS_BM"] * ROWB_E <= (d["WS_BM"] + BN) * ROWB
    nj = BN // 8
    passes = 1 if mode == "gate_up" else 2
    for ps in range(passes):
        buf = np.full(d["WS_BM"] * ROWB_E // 4 * 2, np.nan)  # bf16 elements by byte address / 2
        for warp in range(NC // 32):
            for hi in range(2):
                for j in range(16):
                    banks = []
                    for lane in range(32):
                        tid = warp * 32 + lane
                        wg, wq, g8, t4 = tid >> 7, (tid >> 5) & 3, lane >> 2, lane & 3
                        r = wg * 64 + wq * 16 + g8 + hi * 8
                        addr = r * ROWB_E + 4 * t4 + 16 * j
                        banks.append((addr // 4) % 32)
                        if r >= rows:
                            continue
                        regs = regs_of[tid]
                        for b in range(2):
                            if mode == "gate_up":
                                v, u = regs[4 * j + 2 * hi + b], regs[4 * (j + nj // 2) + 2 * hi + b]
                                val = v / (1 + np.exp(-v)) * u
                            else:
                                assert pair_w is not None
                                val = pair_w[int(pair_list[start + r])] * regs[4 * (j + 16 * ps) + 2 * hi + b]
                            buf[addr // 2 + b] = val
                    assert len(set(banks)) == 32, ("bank conflict in the staged epilogue", warp, hi, j)
        for tid in range(NC):
            for i in range(d["WS_BM"] * 16 // NC):  # WS_EPI_COPIES
                r, c = (tid >> 4) + (NC // 16) * i, tid & 15
                if r >= rows:
                    continue
                p = int(pair_list[start + r])
                if mode == "gate_up":
                    dst = p * I + x * (BN // 2) + 8 * c
                else:
                    t, slot = p // kk, p % kk
                    dst = (t * ny + slot) * H + x * BN + 128 * ps + 8 * c
                chunk = buf[(r * ROWB_E + 16 * c) // 2:(r * ROWB_E + 16 * c) // 2 + 8]
                assert not np.isnan(chunk).any(), ("copy of a byte the pass did not write", r, c)
                out[dst:dst + 8] = chunk


class _MBarrier:
    """An mbarrier: ``count`` arrivals complete the current phase; ``phase`` = phases completed so far.
    try_wait.parity(P) succeeds iff the phase of parity P most recently due has completed, i.e. the current
    (incomplete) phase's parity is not P."""

    def __init__(self, count: int) -> None:
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self, want_phase: int) -> None:
        assert self.phase == want_phase, ("arrival for phase", want_phase, "while in phase", self.phase)
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.phase += 1
            self.pending = self.count

    def ready(self, parity: int) -> bool:
        return (self.phase & 1) != parity


def ws_protocol_sim(kts: list[int], stages: int, lag: int, producers: int = 2, consumers: int = 2,
                    seed: int = 0, staged: bool = False) -> int:
    """Random interleavings of moe_wgmma_ws.cu's producer and consumer threads over one CTA's work items (k
    tiles per item ``kts``), transcribed statement by statement: mbarrier waits and arrivals (phase parity),
    cp.async groups that land at any time (cp.async.wait_group LAG blocks until all but the newest LAG have),
    MMAs that may read a stage until the wgmma.wait_group that guarantees them; with ``staged``
    (``-DWS_STAGED_EPI=1``) the epilogue that stages an item's rows in its last stage after a barrier of the
    consumers. Asserts: an MMA reads a stage only after every producer thread's copies of exactly
    that k tile landed; a copy never overwrites a stage an MMA may still read or the epilogue still uses; every
    arrival is for the barrier's current phase; no deadlock (some thread can always move or some copy land).
    Returns the number of steps taken."""
    rng = np.random.default_rng(seed)
    S = stages
    full = [_MBarrier(producers) for _ in range(S)]
    empty = [_MBarrier(consumers) for _ in range(S)]
    seq = [(it, kt) for it, n in enumerate(kts) for kt in range(n)]  # global stage counter g -> (item, k tile)
    content: list[dict[int, tuple[int, int] | None]] = [{} for _ in range(S)]  # stage -> producer -> landed tile
    reading: list[set[tuple[int, int]]] = [set() for _ in range(S)]  # (consumer, g) whose MMAs may read it
    groups: dict[int, list[tuple[int, tuple[int, int]]]] = {pt: [] for pt in range(producers)}  # pending cp.async
    staging: list[set[int]] = [set() for _ in range(S)]  # consumers whose epilogue writes / reads the stage
    at_barrier = [0] * len(kts)  # consumers arrived at the staged epilogue's first barrier, per item

    def producer(pt: int) -> Iterator[bool]:  # yields False while blocked
        for g, tile in enumerate(seq):
            stage, rnd = g % S, g // S
            while not empty[stage].ready((rnd & 1) ^ 1):
                yield False
            assert not reading[stage], ("copy over a stage in use", g, reading[stage])
            assert not staging[stage], ("copy over a stage the epilogue uses", g, staging[stage])
            content[stage][pt] = None
            groups[pt].append((stage, tile))
            yield True
            while len(groups[pt]) > lag:  # cp.async.wait_group LAG
                yield False
            if g >= lag:
                full[(g - lag) % S].arrive((g - lag) // S)
            yield True
        g = len(seq)
        while groups[pt]:  # cp.async.wait_group 0
            yield False
        for j in range(max(0, g - lag), g):
            full[j % S].arrive(j // S)

    def consumer(c: int) -> Iterator[bool]:
        g = 0
        for it, n in enumerate(kts):
            for kt in range(n):
                stage = g % S
                while not full[stage].ready((g // S) & 1):
                    yield False
                for pt in range(producers):
                    assert content[stage].get(pt) == (it, kt), ("MMA before its copies landed", g, content[stage])
                reading[stage].add((c, g))
                yield True
                if kt > 0:  # wgmma.wait_group 1: the MMAs of g - 1 have completed
                    reading[(g - 1) % S].discard((c, g - 1))
                    empty[(g - 1) % S].arrive((g - 1) // S)
                g += 1
                yield True
            if n:  # wait_group 0, then the epilogue
                reading[(g - 1) % S].discard((c, g - 1))
                if staged:  # bar.sync of the consumers, rows staged in the item's last stage, bar.sync, free it
                    at_barrier[it] += 1
                    while at_barrier[it] < consumers:
                        yield False
                    assert not reading[(g - 1) % S], ("staging over a stage an MMA may read", g)
                    staging[(g - 1) % S].add(c)
                    yield True
                    staging[(g - 1) % S].discard(c)
                empty[(g - 1) % S].arrive((g - 1) // S)
            yield True

    def land(pt: int, group: tuple[int, tuple[int, int]]) -> None:
        stage, tile = group
        content[stage][pt] = tile

    gens: dict[tuple[str, int], Iterator[bool]] = {("p", i): producer(i) for i in range(producers)}
    gens |= {("c", i): consumer(i) for i in range(consumers)}
    return run_interleaved(gens, groups, land, rng)


def run_interleaved(gens: dict, groups: dict, land: Callable[[Any, Any], None], rng: np.random.Generator) -> int:
    """Runs thread generators (``next`` yields True when the thread moved, False while it is blocked) in a random
    interleaving with the landing of cp.async groups: each step either advances one live thread or lands the
    oldest pending group of one copying thread (``groups[key]``, a FIFO; ``land(key, group)`` records it). Asserts
    no deadlock (no thread can move and no group is pending, 10 000 times running) and that every group landed.
    Returns the steps taken."""
    steps, stuck = 0, 0
    while gens:
        steps += 1
        keys = sorted(gens)
        lands = [k for k in groups if groups[k]]
        pick = int(rng.integers(len(keys) + len(lands)))
        if pick >= len(keys):  # the oldest pending group of one copying thread lands
            k = lands[pick - len(keys)]
            land(k, groups[k].pop(0))
            stuck = 0
            continue
        who = keys[pick]
        try:
            moved = next(gens[who])
        except StopIteration:
            del gens[who]
            stuck = 0
            continue
        stuck = 0 if moved else stuck + 1
        assert stuck < 10_000 or any(groups.values()), ("deadlock", steps)
    assert not any(groups.values())
    return steps
