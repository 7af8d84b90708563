"""The synchronisation of ``ops/cuda/prefill_attention_wgmma.cu``'s warp-specialised build (``-DWS``) on a CPU:
its producer warpgroup and two consumer warpgroups transcribed statement by statement (mbarrier waits and
arrivals with phase parity, cp.async groups that land at any time, wgmmas that may read a stage until the
wgmma.wait_group that guarantees them, the named barriers of the consumers' ping-pong) and run under random
interleavings. The source's handshake lines are checked to be the ones modelled, so an edit to the kernel's
protocol fails here until the model follows it."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import pytest
from moe_wgmma_model import _MBarrier, run_interleaved

from hybrid_runtime.cuda.kernels import source


class _NamedBarrier:
    """bar.sync / bar.arrive with ``count`` threads: a generation completes when ``count`` threads have arrived
    (bar.sync arrives and waits for its generation; bar.arrive only arrives)."""

    def __init__(self, count: int) -> None:
        self.count, self.arrived, self.generation = count, 0, 0

    def arrive(self) -> int:
        gen = self.generation
        self.arrived += 1
        assert self.arrived <= self.count
        if self.arrived == self.count:
            self.generation += 1
            self.arrived = 0
        return gen

    def done(self, gen: int) -> bool:
        return self.generation > gen


def ws_attention_sim(nkt: int, seed: int, producers: int = 2, per_wg: int = 2, swap_parity: bool = False) -> int:
    """One CTA of ``prefill_attn_wgmma_ws`` over ``nkt`` key tiles. ``producers`` threads stand for the producer
    warpgroup and ``per_wg`` threads for each consumer warpgroup (the barrier counts scale with them, as 128 and
    256 do in the kernel). Asserts: S_j reads K_j only after every producer thread's copy of tile j landed (and
    P V_j V_j's); no copy overwrites a stage a wgmma may still read; arrivals in phase; the two warpgroups issue
    S in turn (0, 1, 0, 1, ...); no deadlock. ``swap_parity`` breaks the consumers' wait parity (the test that
    the simulation can fail). Returns the steps taken."""
    rng = np.random.default_rng(seed)
    n_cons = 2 * per_wg
    full_k = [_MBarrier(producers) for _ in range(2)]
    full_v = [_MBarrier(producers) for _ in range(2)]
    empty_k = [_MBarrier(n_cons) for _ in range(2)]
    empty_v = [_MBarrier(n_cons) for _ in range(2)]
    turn = [_NamedBarrier(2 * per_wg), _NamedBarrier(2 * per_wg)]  # ids 1, 2: warpgroup 0's, 1's turn
    content: dict[tuple[str, int], dict[int, int | None]] = {(r, s): {} for r in "KV" for s in range(2)}
    reading: dict[tuple[str, int], set[tuple[int, int]]] = {(r, s): set() for r in "KV" for s in range(2)}
    groups: dict[int, list[tuple[str, int, int]]] = {p: [] for p in range(producers)}  # pending cp.async groups
    issue_order: list[int] = []

    def copy(p: int, ring: str, j: int) -> None:
        key = (ring, j & 1)
        assert not reading[key], ("copy over a stage a wgmma may read", ring, j, reading[key])
        content[key][p] = None
        groups[p].append((ring, j & 1, j))

    def producer(p: int) -> Iterator[bool]:
        for j in range(nkt):
            st, par = j & 1, ((j >> 1) & 1) ^ 1
            while not empty_k[st].ready(par):  # mbar_wait_guarded(empty_k + 8 * st, par)
                yield False
            copy(p, "K", j)  # prod_load_tile(sK + st * KV_BYTES, ...); cp_commit()
            yield True
            if j > 0:  # cp_wait1(): all but the newest group (K_j) landed, i.e. V_{j-1}
                while len(groups[p]) > 1:
                    yield False
                full_v[(j - 1) & 1].arrive((j - 1) >> 1)
            while not empty_v[st].ready(par):
                yield False
            copy(p, "V", j)
            yield True
            while len(groups[p]) > 1:  # cp_wait1(): K_j landed
                yield False
            full_k[st].arrive(j >> 1)
            yield True
        while groups[p]:  # cp_wait0()
            yield False
        full_v[(nkt - 1) & 1].arrive((nkt - 1) >> 1)

    def consumer(wg: int, t: int) -> Iterator[bool]:
        me = (wg, t)
        if wg == 1:
            turn[0].arrive()  # warpgroup 0 issues first
        for j in range(nkt):
            st, par = j & 1, (j >> 1) & 1
            if swap_parity:
                par ^= 1
            while not full_k[st].ready(par):
                yield False
            gen = turn[wg].arrive()  # pp_sync(1 + wg)
            while not turn[wg].done(gen):
                yield False
            assert all(content[("K", st)].get(p) == j for p in range(producers)), ("S before K landed", j, content)
            reading[("K", st)].add(me)  # issue_s + commit
            if t == 0:
                issue_order.append(wg)
            turn[1 - wg].arrive()  # pp_arrive(2 - wg)
            yield True
            reading[("K", st)].discard(me)  # wgmma_wait0
            empty_k[st].arrive(j >> 1)
            yield True
            while not full_v[st].ready(par):  # softmax, then the wait for V_j
                yield False
            assert all(content[("V", st)].get(p) == j for p in range(producers)), ("P V before V landed", j)
            reading[("V", st)].add(me)  # issue_pv + commit
            yield True
            reading[("V", st)].discard(me)  # wgmma_wait0
            empty_v[st].arrive(j >> 1)
            yield True
        if wg == 0:  # pp_sync(1): warpgroup 1's last arrival
            gen = turn[0].arrive()
            while not turn[0].done(gen):
                yield False

    def land(p: int, group: tuple[str, int, int]) -> None:
        ring, st, j = group
        content[(ring, st)][p] = j

    gens: dict[tuple[str, int, int], Iterator[bool]] = {("p", p, 0): producer(p) for p in range(producers)}
    gens |= {("c", wg, t): consumer(wg, t) for wg in range(2) for t in range(per_wg)}
    steps = run_interleaved(gens, groups, land, rng)
    assert issue_order == [0, 1] * nkt, issue_order
    assert all(b.arrived == 0 for b in turn), "a named barrier left with pending arrivals"
    return steps


@pytest.mark.parametrize("nkt", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("seed", range(8))
def test_ws_attention_protocol_is_safe_and_deadlock_free(nkt: int, seed: int) -> None:
    assert ws_attention_sim(nkt, seed) > 0


def test_ws_attention_sim_catches_a_wrong_parity() -> None:
    """The consumers waiting for the other parity read a stage before its copies land (or never wake): the
    simulation must fail, or it proves nothing."""
    with pytest.raises(AssertionError):
        for seed in range(8):
            ws_attention_sim(4, seed, swap_parity=True)


def test_the_modelled_handshake_is_the_kernels() -> None:
    """The lines of the WS kernel the simulation transcribes (barrier counts, waits, arrivals, the turn-taking),
    in the order modelled."""
    src = source("prefill_attention_wgmma.cu")
    ws = src[src.index("#ifdef WS"):]
    body = ws[ws.index("prefill_attn_wgmma_ws("):]
    want_producer = [
        "mbar_wait_guarded(empty_k + 8 * st, par)", "prod_load_tile(sK + st * KV_BYTES", "cp_commit()",
        "cp_wait1()", "mbar_arrive(full_v + 8 * ((j - 1) & 1))", "mbar_wait_guarded(empty_v + 8 * st, par)",
        "prod_load_tile(sV + st * KV_BYTES", "cp_commit()", "cp_wait1()", "mbar_arrive(full_k + 8 * st)",
        "cp_wait0()", "mbar_arrive(full_v + 8 * ((nkt - 1) & 1))"]
    want_consumer = [
        "if (wg == 1) pp_arrive(1)", "mbar_wait(full_k + 8 * st, par)", "pp_sync(1 + wg)", "issue_s(",
        "wgmma_commit()", "pp_arrive(2 - wg)", "wgmma_wait0()", "mbar_arrive(empty_k + 8 * st)",
        "tile_softmax(", "mbar_wait(full_v + 8 * st, par)", "issue_pv(", "wgmma_commit()", "wgmma_wait0()",
        "mbar_arrive(empty_v + 8 * st)", "if (wg == 0) pp_sync(1)"]
    split = body.index("consumer warpgroups")
    for part, want in ((body[:split], want_producer), (body[split:], want_consumer)):
        pos = 0
        for w in want:
            i = part.find(w, pos)
            assert i >= 0, f"{w!r} not found after offset {pos} in the WS kernel"
            pos = i + len(w)
    for bar, count in (("full_k", "PT"), ("full_v", "PT"), ("empty_k", "NTHREADS"), ("empty_v", "NTHREADS")):
        assert re.search(rf"mbar_init\({bar} \+ 8 \* s, {count}\)", body), bar
    assert "const u32 st = (u32)(j & 1), par = ((u32)(j >> 1) & 1u) ^ 1u;" in body  # the producer's parity
    assert "const u32 st = (u32)(j & 1), par = (u32)(j >> 1) & 1u;" in body  # the consumers'
