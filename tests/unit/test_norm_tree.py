"""fused.cu's ``rmsnorm_rows`` on any machine: a numpy model of how its threads sum a row's squares (groups of 4
columns, thread t holding groups t + k P, the in-thread halving tree over k, warp 0 folding the warps from shared
memory, then ``warp_sum``'s xor butterfly) gives one fixed tree whatever the block size P, the NORM_KMAX build or
the row width, which is why ``norm_block`` may pick the block by row count without changing a row's bits (decode
rows and prefill rows alike); and ``norm_block``'s choices are launchable."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid_runtime.cuda.backend import NORM_FEW_ROWS, NORM_KMAX, NORM_MAX_THREADS, norm_block

f32 = np.float32


def partials(v: np.ndarray) -> np.ndarray:
    """One float32 partial per 4-column group (columns past H are 0). The kernel's expression is an fma chain; any
    fixed function of the group serves the model, since every P computes it from the same 4 values."""
    G = -(-len(v) // 4)
    g = np.zeros(4 * G, np.float64)
    g[:len(v)] = v
    return (g.reshape(G, 4) ** 2).sum(1).astype(f32)


def halving_tree(a: list) -> np.float32:
    """The kernel's tree_sum: a[i] += a[i + N/2] for i < N/2, then N/4, ... (N a power of two), float32 adds."""
    a = [f32(x) for x in a]
    n = len(a)
    assert n & (n - 1) == 0
    while n > 1:
        n //= 2
        a = [f32(a[i] + a[i + n]) for i in range(n)]
    return a[0]


def canonical(p: np.ndarray) -> np.float32:
    """The tree the kernel's comment defines: the partials zero-padded to a power of two, halving strides."""
    n = 1 << max(0, (len(p) - 1).bit_length())
    return halving_tree(list(p) + [f32(0)] * (n - len(p)))


def kernel_model(p: np.ndarray, P: int, kmax: int) -> np.float32:
    """rmsnorm_body's reduction step by step for a block of P threads."""
    G = len(p)
    assert P & (P - 1) == 0 and 32 <= P <= NORM_MAX_THREADS and kmax * P >= G
    q = []
    for t in range(P):  # each thread: its groups t + k P (0 past G), tree_sum over k
        q.append(halving_tree([p[t + k * P] if t + k * P < G else f32(0) for k in range(kmax)]))
    red = list(q)
    W = P // 32
    lanes = []
    for lane in range(32):  # warp 0, lane l: red[l + 32 i] folded in place over i, strides W/2 .. 1
        st = W // 2
        while st >= 1:
            for i in range(st):
                red[lane + 32 * i] = f32(red[lane + 32 * i] + red[lane + 32 * (i + st)])
            st //= 2
        lanes.append(red[lane])
    for o in (16, 8, 4, 2, 1):  # warp_sum: __shfl_xor_sync butterfly
        lanes = [f32(lanes[i] + lanes[i ^ o]) for i in range(32)]
    assert all(x.tobytes() == lanes[0].tobytes() for x in lanes)  # every lane holds the same sum (a + b == b + a)
    return lanes[0]


@pytest.mark.parametrize("H", [2048, 128, 96, 98, 1000, 4096, 8192])
def test_every_block_size_sums_a_row_with_the_same_tree(H: int) -> None:
    rng = np.random.default_rng(H)
    v = (rng.standard_normal(H) * np.exp(rng.standard_normal(H) * 3)).astype(f32)  # wide range: order matters
    p = partials(v)
    want = canonical(p)
    G = len(p)
    got = {}
    for kmax in (NORM_KMAX, 8):
        for P in (32, 64, 128, 256, 512):
            if kmax * P >= G:
                got[(P, kmax)] = kernel_model(p, P, kmax)
    assert got
    assert all(x.tobytes() == want.tobytes() for x in got.values()), {k: float(x) for k, x in got.items()}
    assert abs(float(want) - float((v.astype(np.float64) ** 2).sum())) <= 1e-5 * float(want)  # and it is the sum


def test_the_tree_is_order_sensitive_so_the_model_is_not_vacuous() -> None:
    rng = np.random.default_rng(0)
    differ = 0
    for _ in range(50):
        p = partials((rng.standard_normal(2048) * np.exp(rng.standard_normal(2048) * 3)).astype(f32))
        seq = f32(0)
        for x in p:
            seq = f32(seq + x)
        differ += seq.tobytes() != canonical(p).tobytes()
    assert differ > 0


def test_norm_block_choices() -> None:
    for H in (16, 32, 96, 98, 128, 1000, 2048, 4096, 8192, 8196, 16384, 40000):
        G = -(-H // 4)
        for rows in (1, 16, NORM_FEW_ROWS, NORM_FEW_ROWS + 1, 8192):
            P, kmax = norm_block(H, rows)
            assert P & (P - 1) == 0 and 32 <= P <= NORM_MAX_THREADS, (H, rows, P)
            assert kmax & (kmax - 1) == 0 and kmax >= NORM_KMAX and P * kmax >= G, (H, rows, P, kmax)
            assert (kmax == NORM_KMAX) == (H <= 4 * NORM_KMAX * NORM_MAX_THREADS)
    assert norm_block(2048, 1) == (512, NORM_KMAX)  # decode: one 4-column group per thread
    assert norm_block(2048, 16) == (512, NORM_KMAX)
    assert norm_block(2048, 8192) == (256, NORM_KMAX)  # prefill: 256 threads, two groups each
    assert norm_block(128, 8192) == (32, NORM_KMAX)
    assert norm_block(8192, 8192) == (512, NORM_KMAX)
