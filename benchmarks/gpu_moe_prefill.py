"""The prefill MoE's routed experts on the Qwen3.5-35B-A3B expert shape (H 2048, 256 experts of I 512, top-8):
the tensor-core path (``cuda/moe_prefill.py``: device routing + tile list, grouped GEMMs on mma.sync) against the
CUDA-core kernels it replaces in prefill (``fused.cu``: one-CTA ``moe_route``, ``moe_gate_up``, ``moe_down``),
and against a dense bf16 cuBLASLt GEMM measured in the same run ([8192 x 2048] @ [2048 x 8192]).

    python3 -m benchmarks.gpu_moe_prefill --impl mma,wgmma,wgmma128,wgmma_ws

``--y-dtype``: the slots the down GEMM writes, bfloat16 (default: the backend's prefill steps) or float32.
``--impl``: the grouped-GEMM builds to time (``MoEPrefill(impl=...)``: mma.sync, wgmma 128 x 256, wgmma 128 x 128,
the warp-specialised persistent wgmma 128 x 256),
one table row per (tokens, build); the CUDA-core baseline is timed once per token count.

Random bf16 weights generated on the device (one copy: 1.5 GB, every step reads all 256 experts, far past the
L2), random bf16 h and float32 router logits. Times: CUDA events around back-to-back calls queued behind a spin
kernel (no host gaps), median of 3 means. Achieved rate = 2 * pairs * (2I*H + I*H) / time, pairs = n * k.
"""

# ruff: noqa: B023 - every closure below is timed (called) inside the loop iteration that defines it
from __future__ import annotations

import argparse
import datetime
from typing import Any

from benchmarks.gpu_common import log, time_on_stream, write_report

H, INTER, E, K = 2048, 512, 256, 8
TOKENS = (1024, 4096, 8192)


def timed(dev: Any, fn: Any, reps: int = 20) -> float:
    """Median of 3 means (seconds) over ``reps`` back-to-back calls queued behind a spin kernel."""
    return time_on_stream(dev, lambda _i: fn(), reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/results/gpu_moe_prefill_h200.md")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--impl", default="mma,wgmma", help="comma-separated MoEPrefill impls to compare")
    ap.add_argument("--y-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the routed slots' dtype: bfloat16 (the backend's prefill steps, the _t down kernels) or "
                         "float32")
    args = ap.parse_args()
    import torch

    from hybrid_runtime.cuda.backend import MOE_ROWS_PER_CTA, SMEM_DEFAULT, fill_random
    from hybrid_runtime.cuda.blas import Blas
    from hybrid_runtime.cuda.driver import CudaDevice
    from hybrid_runtime.cuda.kernels import load_module
    from hybrid_runtime.cuda.moe_prefill import ROUTE_MAX_CTAS, MoEBuffers, MoEPrefill, tile_list_words
    from hybrid_runtime.cuda.weights import MoEWeights

    torch.cuda.init()
    dev = CudaDevice(0)
    fused = load_module("fused.cu", ("-DDT=2",), dev.arch)
    impls = [x for x in args.impl.split(",") if x]
    moes = {impl: MoEPrefill(dev, "bfloat16", impl=impl) for impl in impls}
    blas = Blas(dev)
    log(f"device {dev.limits.name}")

    # dense reference: [8192 x 2048] @ [2048 x 8192], bf16 in and out, cuBLASLt's heuristic algorithm
    M = N = 8192
    x = dev.empty((M, H), "bfloat16")
    w = dev.empty((N, H), "bfloat16")
    yd = dev.empty((M, N), "bfloat16")
    fill_random(dev, fused, x, 1, 1.0)
    fill_random(dev, fused, w, 2, 1.0 / 45)
    t_dense = timed(dev, lambda: blas.gemm(M, N, H, x.ptr, w.ptr, yd.ptr, dtype="bfloat16", out_dtype="bfloat16"))
    dense = 2.0 * M * N * H / t_dense
    log(f"cuBLASLt dense bf16 {M}x{H} @ {H}x{N}: {t_dense * 1e6:.0f} us, {dense / 1e12:.0f} TFLOP/s")

    gu = dev.empty((E, 2 * INTER, H), "bfloat16")
    dn = dev.empty((E, H, INTER), "bfloat16")
    fill_random(dev, fused, gu, 3, 1.0 / 45)
    fill_random(dev, fused, dn, 4, 1.0 / 22)
    mw = MoEWeights(dev.zeros((8, H), "bfloat16"), 8, gu, dn, E, False, None, None)
    ld = 264
    rows = []
    for n in [int(t) for t in args.tokens.split(",")]:
        P = n * K
        ny = K + 1
        h = dev.empty((n, H), "bfloat16")
        lg = dev.empty((n, ld), "float32")
        fill_random(dev, fused, h, 5 + n, 1.0)
        fused.kernel("fill_random_f32").launch(dev, (4096, 1, 1), (256, 1, 1), 0,
                                               [("ptr", lg.ptr), ("i64", lg.size), ("u64", 7 + n), ("f32", 2.0),
                                                ("f32", 0.0)])
        b = {name: dev.empty(shape, dt) for name, shape, dt in (
            ("pw", (P,), "float32"), ("pe", (P,), "int32"), ("pl", (P,), "int32"), ("off", (E + 2,), "int32"),
            ("active", (E + 2,), "int32"), ("tiles", (tile_list_words(P, E),), "int32"),
            ("cta", (ROUTE_MAX_CTAS, E), "int32"), ("act", (P, INTER), "bfloat16"),
            ("y", (n, ny, H), args.y_dtype), ("y32", (n, ny, H), "float32"))}
        bufs = MoEBuffers(b["pw"].ptr, b["pe"].ptr, b["pl"].ptr, b["off"].ptr, b["active"].ptr, b["tiles"].ptr,
                          b["cta"].ptr, b["act"].ptr, b["y"].ptr, (b["tiles"].size - 4) // 4)


        tg = max(1, min(8, SMEM_DEFAULT // (H * 2)))
        tg_d = max(1, min(8, SMEM_DEFAULT // (INTER * 2)))
        ny_grid = min(E, P)

        def old_route() -> None:
            fused.kernel("moe_route").launch(
                dev, (1, 1, 1), (1024, 1, 1), 0,
                [("ptr", lg.ptr), ("i32", ld), ("i32", n), ("i32", E), ("i32", K), ("i32", 1), ("i32", 0),
                 ("ptr", b["pw"].ptr), ("ptr", b["pe"].ptr), ("ptr", b["off"].ptr), ("ptr", b["pl"].ptr),
                 ("ptr", b["active"].ptr)], pdl=True)

        def old_all() -> None:
            old_route()
            fused.kernel("moe_gate_up").launch(
                dev, (-(-INTER // MOE_ROWS_PER_CTA), ny_grid, 1), (256, 1, 1), tg * H * 2,
                [("ptr", h.ptr), ("ptr", gu.ptr), ("i32", H), ("i32", INTER), ("i32", K), ("i32", E),
                 ("ptr", b["off"].ptr), ("ptr", b["pl"].ptr), ("ptr", b["active"].ptr), ("ptr", b["act"].ptr),
                 ("i32", tg)], pdl=True)
            fused.kernel("moe_down").launch(
                dev, (-(-H // MOE_ROWS_PER_CTA), ny_grid, 1), (256, 1, 1), tg_d * INTER * 2,
                [("ptr", b["act"].ptr), ("ptr", dn.ptr), ("ptr", b["pw"].ptr), ("i32", H), ("i32", INTER),
                 ("i32", K), ("i32", ny), ("i32", E), ("ptr", b["off"].ptr), ("ptr", b["pl"].ptr),
                 ("ptr", b["active"].ptr), ("ptr", b["y32"].ptr), ("i32", tg_d)], pdl=True)

        t_old = timed(dev, old_all, reps=5)
        t_old_route = timed(dev, old_route, reps=5)
        flops = 2.0 * P * (2 * INTER * H + INTER * H)
        for impl, moe in moes.items():

            def new_all() -> None:
                moe.launch(n, lg.ptr, ld, mw, h.ptr, H, K, True, ny, bufs, y_dtype=args.y_dtype)

            def new_route() -> None:
                moe.route(n, lg.ptr, ld, E, K, True, bufs)

            def new_gemms(which: str = "both") -> None:
                moe.experts(n, h.ptr, H, gu.ptr, dn.ptr, H, INTER, K, ny, E, bufs, y_dtype=args.y_dtype, gemms=which)

            t_new = timed(dev, new_all)
            t_route = timed(dev, new_route)
            new_route()
            t_gemm = timed(dev, new_gemms)
            t_gu = timed(dev, lambda: new_gemms("gate_up"))
            t_dn = timed(dev, lambda: new_gemms("down"))
            r = {"n": n, "pairs": P, "impl": f"{impl} ({moe.gemm_impl(H, INTER)})", "new": t_new, "route": t_route,
                 "gemms": t_gemm, "gate_up": t_gu, "down": t_dn,
                 "old": t_old, "old_route": t_old_route, "tflops": flops / t_new / 1e12,
                 "gemm_tflops": flops / t_gemm / 1e12, "old_tflops": flops / t_old / 1e12}
            log(r)
            rows.append(r)

    lines = [f"# Prefill MoE, tensor cores vs CUDA cores ({dev.limits.name}, "
             f"{datetime.date.today().isoformat()})", "",
             f"Qwen3.5-35B-A3B routed experts: H {H}, {E} experts of I {INTER}, top-{K}, random bf16 weights; "
             f"`python3 -m benchmarks.gpu_moe_prefill`. Dense reference: cuBLASLt bf16 [{M} x {H}] @ [{H} x {N}] "
             f"= {t_dense * 1e6:.0f} us, **{dense / 1e12:.0f} TFLOP/s**. Rate = 2 * pairs * 3 * I * H / time. "
             f"Routed slots in {args.y_dtype} (`--y-dtype`; the CUDA-core baseline writes float32).", "",
             "| tokens | pairs | GEMM build | tensor cores: all (us) | routing (us) | 2 GEMMs (us) "
             "| gate_up alone (us) | down alone (us) | TFLOP/s all | TFLOP/s GEMMs "
             "| share of dense | CUDA cores: all (us) | moe_route (us) | TFLOP/s | speed-up |",
             "|---:|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['pairs']} | {r['impl']} | {r['new'] * 1e6:.0f} | {r['route'] * 1e6:.1f} | "
                     f"{r['gemms'] * 1e6:.0f} | {r['gate_up'] * 1e6:.0f} | {r['down'] * 1e6:.0f} | "
                     f"{r['tflops']:.0f} | {r['gemm_tflops']:.0f} | "
                     f"{r['tflops'] * 1e12 / dense:.0%} | {r['old'] * 1e6:.0f} | {r['old_route'] * 1e6:.0f} | "
                     f"{r['old_tflops']:.1f} | {r['old'] / r['new']:.1f}x |")
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
