"""Decode-step kernels one at a time on the Qwen3.5-35B-A3B shapes, each against the copy bandwidth measured in
the same run, for several compile-time configurations: which ``gemv`` / MoE build the runtime should use, and
how it compares with cuBLASLt.

    python3 -m benchmarks.gpu_kernel_tune --out benchmarks/results/gpu_kernel_tune_h200.md

Every call rotates over enough copies of its weights to exceed 4x the L2, so none reads from cache; times are
CUDA-event means over back-to-back launches (no host work between them).
"""

# ruff: noqa: B023 - every closure below is timed (called) inside the loop iteration that defines it
from __future__ import annotations

import argparse
import math
from typing import Any

from benchmarks.gpu_common import log, measure_copy_bandwidth, time_on_stream, write_report

SHAPES = [("in_proj (GDN)", 12352, 2048), ("qkv_proj", 9216, 2048), ("out_proj / o_proj", 2048, 4096),
          ("lm_head", 248320, 2048), ("router + shared gate", 264, 2048)]
GEMV_VARIANTS = [(1, 4), (2, 4), (4, 4), (2, 8), (1, 8), (2, 2)]
MOE_VARIANTS = [(1, 4), (2, 4), (2, 2), (1, 8)]


def timed(dev: Any, fn: Any, reps: int = 40) -> float:
    """Median of 3 means over ``reps`` back-to-back calls; a spin kernel first keeps the GPU busy while the host
    enqueues them, so small kernels are timed, not Python's launch rate."""
    return time_on_stream(dev, fn, reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/results/gpu_kernel_tune_h200.md")
    args = ap.parse_args()
    import torch

    from hybrid_runtime.cuda.blas import Blas
    from hybrid_runtime.cuda.driver import CudaDevice
    from hybrid_runtime.cuda.kernels import load_module

    torch.cuda.init()
    dev0 = CudaDevice(0, stream=0)
    bw = measure_copy_bandwidth(torch, dev0)
    dev = CudaDevice(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    blas = Blas(dev)
    lines = [f"# Decode kernels on the 35B-A3B shapes ({torch.cuda.get_device_name(0)})", "",
             f"`python3 -m benchmarks.gpu_kernel_tune`; copy bandwidth in this run {bw / 1e12:.2f} TB/s. "
             "Cells: microseconds per call (effective TB/s of the bytes the call must read).", "",
             "## Dense projections: fused gemv builds (GEMV_RW rows per warp, GEMV_UNROLL k-steps in flight) vs "
             "cuBLASLt", ""]
    head = "| shape | M | bytes (MB) | floor (us) | " + " | ".join(f"gemv RW{r} U{u}" for r, u in GEMV_VARIANTS) + \
        " | cuBLASLt |"
    lines += [head, "|" + "---|" * (5 + len(GEMV_VARIANTS))]
    mods = {v: load_module("fused.cu", ("-DDT=2", f"-DGEMV_RW={v[0]}", f"-DGEMV_UNROLL={v[1]}"), dev.arch)
            for v in GEMV_VARIANTS}
    for name, N, K in SHAPES:
        wb = N * K * 2
        copies = int(min(16, max(1, math.ceil(4 * l2 / wb))))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for M in (1, 8):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(M, N, device="cuda", dtype=torch.float32)
            cells = []
            for v in GEMV_VARIANTS:
                kern = mods[v].kernel("gemv")
                grid = (-(-N // (4 * v[0])), 1, 1)

                def call(i: int, kern: Any = kern, grid: tuple = grid) -> None:
                    kern.launch(dev, grid, (128, 1, 1), 0,
                                [("ptr", x.data_ptr()), ("i64", K), ("ptr", ws[i % copies].data_ptr()), ("i32", N),
                                 ("i32", K), ("ptr", 0), ("ptr", 0), ("i64", 0), ("ptr", y.data_ptr()), ("i64", N),
                                 ("i32", 1), ("i32", M)], pdl=True)

                t = timed(dev, call)
                cells.append(f"{t * 1e6:.1f} ({wb / t / 1e12:.2f})")

            def cub(i: int) -> None:
                blas.gemm(M, N, K, x.data_ptr(), ws[i % copies].data_ptr(), y.data_ptr(), dtype="bfloat16",
                          out_dtype="float32")

            t = timed(dev, cub)
            lines.append(f"| {name} | {M} | {wb / 1e6:.1f} | {wb / bw * 1e6:.1f} | " + " | ".join(cells) +
                         f" | {t * 1e6:.1f} ({wb / t / 1e12:.2f}) |")
            log(lines[-1])
        ws.clear()
        torch.cuda.empty_cache()
    # ---- MoE experts
    H, inter, E, k = 2048, 512, 256, 8
    lines += ["", "## Routed experts (gate_up + down, shared expert folded), by build (MOE_RPW rows per warp, "
              "MOE_UNROLL)", "", "| batch | distinct experts | bytes (MB) | floor (us) | " +
              " | ".join(f"RPW{r} U{u}" for r, u in MOE_VARIANTS) + " |", "|" + "---|" * (4 + len(MOE_VARIANTS))]
    layers = 4
    gu = [torch.randn(E + 1, 2 * inter, H, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
    dn = [torch.randn(E + 1, H, inter, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
    base = load_module("fused.cu", ("-DDT=2",), dev.arch)
    moe_mods = {v: load_module("fused.cu", ("-DDT=2", f"-DMOE_RPW={v[0]}", f"-DMOE_UNROLL={v[1]}"), dev.arch)
                for v in MOE_VARIANTS}
    for B in (1, 8, 64):
        kk = k + 1
        lg = torch.randn(B, 264, device="cuda", dtype=torch.float32)
        h = torch.randn(B, H, device="cuda", dtype=torch.bfloat16)
        pw = torch.empty(B * kk, device="cuda", dtype=torch.float32)
        pe, pl = (torch.empty(B * kk, device="cuda", dtype=torch.int32) for _ in range(2))
        off, act_l = (torch.empty(E + 2, device="cuda", dtype=torch.int32) for _ in range(2))
        act = torch.empty(B * kk, inter, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(B, kk, H, device="cuda", dtype=torch.float32)
        route = [("ptr", lg.data_ptr()), ("i32", 264), ("i32", B), ("i32", E), ("i32", k), ("i32", 1), ("i32", 1),
                 ("ptr", pw.data_ptr()), ("ptr", pe.data_ptr()), ("ptr", off.data_ptr()), ("ptr", pl.data_ptr()),
                 ("ptr", act_l.data_ptr())]
        base.kernel("moe_route").launch(dev, (1, 1, 1), (1024, 1, 1), 0, route)
        dev.synchronize()
        distinct = int(act_l[E + 1].item())
        mb = distinct * 3 * H * inter * 2
        grid_y = min(E + 1, B * kk)
        cells = []
        for v in MOE_VARIANTS:
            mod = moe_mods[v]
            rows = 8 * v[0]

            def call(i: int, mod: Any = mod, rows: int = rows) -> None:
                mod.kernel("moe_gate_up").launch(
                    dev, (-(-inter // rows), grid_y, 1), (256, 1, 1), 8 * H * 2,
                    [("ptr", h.data_ptr()), ("ptr", gu[i % layers].data_ptr()), ("i32", H), ("i32", inter),
                     ("i32", kk), ("i32", E + 1), ("ptr", off.data_ptr()), ("ptr", pl.data_ptr()),
                     ("ptr", act_l.data_ptr()), ("ptr", act.data_ptr()), ("i32", 8)], pdl=True)
                mod.kernel("moe_down").launch(
                    dev, (-(-H // rows), grid_y, 1), (256, 1, 1), 8 * inter * 2,
                    [("ptr", act.data_ptr()), ("ptr", dn[i % layers].data_ptr()), ("ptr", pw.data_ptr()),
                     ("i32", H), ("i32", inter), ("i32", kk), ("i32", kk), ("i32", E + 1), ("ptr", off.data_ptr()),
                     ("ptr", pl.data_ptr()), ("ptr", act_l.data_ptr()), ("ptr", y.data_ptr()), ("i32", 8)], pdl=True)

            t = timed(dev, call)
            cells.append(f"{t * 1e6:.1f} ({mb / t / 1e12:.2f})")
        t_route = timed(dev, lambda i: base.kernel("moe_route").launch(dev, (1, 1, 1), (1024, 1, 1), 0, route,
                                                                         pdl=True))
        lines.append(f"| {B} | {distinct} | {mb / 1e6:.1f} | {mb / bw * 1e6:.1f} | " + " | ".join(cells) +
                     f" |  (moe_route alone: {t_route * 1e6:.1f} us)")
        log(lines[-1])
    # ---- the norm of one decode row, by block size
    lines += ["", "## add + RMSNorm of decode rows (x + 9 MoE slots), by threads per row "
              "(benchmarks/gpu_norm.py: every row count, the kernel before)", "",
              "| rows | 128 threads (us) | 256 threads (us) | 512 threads (us) |", "|---|---|---|---|"]
    for n in (1, 8, 64):
        x = torch.randn(n, H, device="cuda", dtype=torch.float32)
        yy = torch.randn(n, 9, H, device="cuda", dtype=torch.float32)
        w = torch.ones(H, device="cuda", dtype=torch.float32)
        hh = torch.empty(n, H, device="cuda", dtype=torch.bfloat16)
        cells = []
        for th in (128, 256, 512):  # rmsnorm_rows: at most 512 (its launch bound), the bits the same at each
            t = timed(dev, lambda i, th=th: base.kernel("rmsnorm_rows").launch(
                dev, (n, 1, 1), (th, 1, 1), 0,
                [("ptr", x.data_ptr()), ("ptr", yy.data_ptr()), ("i32", 9), ("ptr", 0), ("i64", 0),
                 ("ptr", w.data_ptr()), ("ptr", 0), ("ptr", hh.data_ptr()), ("ptr", 0), ("i32", n), ("i32", H),
                 ("f32", 1e-6)], pdl=True))
            cells.append(f"{t * 1e6:.2f}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
