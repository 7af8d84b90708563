"""The decode MoE router on the Qwen3.5-35B-A3B shape (H 2048, 256 experts + the shared expert's gate, E_pad 264
router rows, top-8, the shared expert folded in as expert E): the fused kernel (``cuda/moe_router.py``,
``ops/cuda/moe_router.cu``: router GEMM + routing in one launch) against what it replaces in the backend's
decode steps of <= 16 rows, the cuBLASLt router GEMM (bf16 x bf16 -> float32, its algorithm pinned to M = 16 as
the backend pins it) followed by ``fused.cu``'s one-CTA ``moe_route``.

    python3 -m benchmarks.gpu_moe_router --out benchmarks/results/gpu_moe_router_h200.md

Each time is the mean per router step over ``--reps`` steps launched back to back (the fused kernel and
moe_route as programmatic dependents, ``pdl=True``, as the backend launches them), queued behind a spin kernel
so the GPU never waits for the host; CUDA events; median of 5 such means. Three weight sets: one matrix (hot
in L2), 40 matrices rotated (one per layer of the 35B model, 43 MB), and enough matrices rotated to pass 3x the
L2 (cold: every step reads its 1.08 MB from DRAM, as in a real decode step where the layer's experts flushed
it). Also: the largest difference between the two paths' logits (relative to the largest logit) and whether
they chose the same experts. Random bf16 weights and activations generated on the device. Under a minute.
"""

# ruff: noqa: B023 - every closure below is timed (called) inside the loop iteration that defines it
from __future__ import annotations

import argparse
import datetime
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.gpu_common import log, time_on_stream, write_report

H, E, E_PAD, K = 2048, 256, 264, 8
TOKENS = (1, 8, 16)
LAYERS = 40


def timed(dev: Any, fn: Callable[[int], None], reps: int, host_us: float = 150.0) -> float:
    """Median of 5 means (seconds per call) over ``reps`` back-to-back calls ``fn(i)`` queued behind a spin kernel
    long enough to cover the host's enqueueing (``host_us`` per call at most)."""
    return time_on_stream(dev, fn, reps, runs=5, warmup=(0, 1),
                          spin_cycles=int(max(2e7, reps * host_us * 1e-6 * 2e9)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/results/gpu_moe_router_h200.md")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--rows", default="8,4,16", help="rows per CTA of the fused kernel (the knob), comma-separated")
    ap.add_argument("--reps", type=int, default=120, help="router steps per timed run")
    args = ap.parse_args()
    import torch

    from hybrid_runtime.cuda.backend import fill_random
    from hybrid_runtime.cuda.blas import Blas
    from hybrid_runtime.cuda.driver import CudaDevice, DeviceArray, device_attribute
    from hybrid_runtime.cuda.kernels import load_module
    from hybrid_runtime.cuda.moe_router import MoERouter, RouteBuffers, grid_size

    torch.cuda.init()
    dev = CudaDevice(0)
    fused = load_module("fused.cu", ("-DDT=2",), dev.arch)
    blas = Blas(dev)
    routers = {r: MoERouter(dev, "bfloat16", r) for r in (int(x) for x in args.rows.split(",") if x)}
    l2 = device_attribute(dev.ordinal, "CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE")
    wbytes = E_PAD * H * 2
    n_cold = max(LAYERS, -(-3 * l2 // wbytes))
    log(f"device {dev.limits.name}, L2 {l2 / 2**20:.0f} MiB; router weights {wbytes / 1e6:.2f} MB; cold set "
        f"{n_cold} matrices")

    mats = []
    for i in range(n_cold):  # rows 0..E: experts + the shared gate; E+1..E_pad-1: zero padding, as the weights
        w = dev.zeros((E_PAD, H), "bfloat16")
        fill_random(dev, fused, DeviceArray(w.ptr, (E + 1, H), "bfloat16", dev.ordinal), 100 + i, 1.0 / np.sqrt(H))
        mats.append(w)
    sets = {"hot (1 matrix)": 1, f"{LAYERS} matrices ({LAYERS * wbytes / 1e6:.0f} MB)": LAYERS,
            f"cold ({n_cold} matrices, {n_cold * wbytes / 1e6:.0f} MB)": n_cold}
    n_max, kk = max(int(t) for t in args.tokens.split(",")), K + 1
    P = n_max * kk
    h = dev.empty((n_max, H), "bfloat16")
    fill_random(dev, fused, h, 7, 1.0)
    b = {name: dev.empty(shape, dt) for name, shape, dt in (
        ("logits", (n_max, E_PAD), "float32"), ("pw", (P,), "float32"), ("pe", (P,), "int32"), ("pl", (P,), "int32"),
        ("off", (E + 2,), "int32"), ("active", (E + 2,), "int32"), ("o_logits", (n_max, E_PAD), "float32"),
        ("o_pw", (P,), "float32"), ("o_pe", (P,), "int32"), ("o_pl", (P,), "int32"), ("o_off", (E + 2,), "int32"),
        ("o_active", (E + 2,), "int32"))}
    ws = dev.zeros((4,), "int32")
    bufs = RouteBuffers(b["pw"].ptr, b["pe"].ptr, b["off"].ptr, b["pl"].ptr, b["active"].ptr, ws.ptr)

    rows = []
    for n in [int(t) for t in args.tokens.split(",")]:

        def gemm(i: int, count: int) -> None:
            blas.gemm(n, E_PAD, H, h.ptr, mats[i % count].ptr, b["o_logits"].ptr, dtype="bfloat16",
                      out_dtype="float32", ldx=H, ldy=E_PAD, pin_m=16)

        def route(_i: int) -> None:
            fused.kernel("moe_route").launch(
                dev, (1, 1, 1), (1024, 1, 1), 0,
                [("ptr", b["o_logits"].ptr), ("i32", E_PAD), ("i32", n), ("i32", E), ("i32", K), ("i32", 1),
                 ("i32", 1), ("ptr", b["o_pw"].ptr), ("ptr", b["o_pe"].ptr), ("ptr", b["o_off"].ptr),
                 ("ptr", b["o_pl"].ptr), ("ptr", b["o_active"].ptr)], pdl=True)

        # the two paths once on matrix 0: how far apart their logits are, and their choices
        gemm(0, 1)
        route(0)
        first = next(iter(routers.values()))
        first.launch(n, h.ptr, H, mats[0], b["logits"].ptr, E_PAD, E, K, True, True, bufs)
        dev.synchronize()
        got = {name: dev.download(a) for name, a in b.items()}
        lg, ol = got["logits"][:n], got["o_logits"][:n]
        diff = float(np.abs(lg - ol).max() / max(np.abs(ol).max(), 1e-30))
        same = int((np.sort(got["pe"][:n * kk].reshape(n, kk), 1) == np.sort(got["o_pe"][:n * kk].reshape(n, kk),
                                                                              1)).all(1).sum())
        log(f"n={n}: fused vs cuBLASLt logits max rel diff {diff:.2e}, same experts for {same}/{n} tokens")
        for label, count in sets.items():
            t_old = timed(dev, lambda i: (gemm(i, count), route(i)), args.reps)
            t_gemm = timed(dev, lambda i: gemm(i, count), args.reps)
            t_route = timed(dev, route, args.reps)
            for r, router in routers.items():
                t_new = timed(dev, lambda i: router.launch(n, h.ptr, H, mats[i % count], b["logits"].ptr, E_PAD, E, K,
                                                           True, True, bufs), args.reps)
                row = {"n": n, "weights": label, "rows": r, "ctas": grid_size(E_PAD, r), "new": t_new, "old": t_old,
                       "gemm": t_gemm, "route": t_route, "diff": diff, "same": f"{same}/{n}"}
                log(row)
                rows.append(row)
        assert int(dev.download(ws)[0]) == 0, "the CTA counter was not reset"

    lines = [f"# Decode MoE router, fused kernel vs cuBLASLt + moe_route ({dev.limits.name}, "
             f"{datetime.date.today().isoformat()})", "",
             f"Qwen3.5-35B-A3B router: H {H}, {E} experts + the shared gate (folded), E_pad {E_PAD}, top-{K}, bf16 "
             f"weights ({wbytes / 1e6:.2f} MB per layer); `python3 -m benchmarks.gpu_moe_router`. Mean per router "
             f"step over {args.reps} back-to-back steps (PDL-chained), median of 5; L2 {l2 / 2**20:.0f} MiB. "
             "Old = cuBLASLt GEMM (pinned to M = 16, as the backend) + moe_route.", "",
             "| tokens | weights | rows/CTA (CTAs) | fused (us) | old: GEMM + moe_route (us) | speed-up | GEMM alone "
             "(us) | moe_route alone (us) | logits rel diff | same experts |",
             "|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['weights']} | {r['rows']} ({r['ctas']}) | {r['new'] * 1e6:.2f} | "
                     f"{r['old'] * 1e6:.2f} | {r['old'] / r['new']:.2f}x | {r['gemm'] * 1e6:.2f} | "
                     f"{r['route'] * 1e6:.2f} | {r['diff']:.1e} | {r['same']} |")
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
