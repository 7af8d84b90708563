"""fused.cu's add + RMSNorm on the Qwen3.5-35B-A3B shape (H 2048, x + 9 MoE slots, the last gated as the prefill's
shared expert is), the kernel before issue 16's rework (one CTA of 1024 threads a row, scalar loads, float32 slots;
its source is kept below) against ``rmsnorm_rows`` (16-byte loads, the block by ``norm_block``) with float32 slots
and ``rmsnorm_rows_t`` with bf16 slots (what prefill steps now run), at decode and prefill row counts; then the new
kernel's block sizes at 1 and 8192 rows. Cells: microseconds per call (effective TB/s of the bytes it must move:
x read and written, the slots read, h written).

    python3 -m benchmarks.gpu_norm --out benchmarks/results/gpu_norm_h200.md
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.gpu_common import log, measure_copy_bandwidth, time_on_stream, write_report

H, NY = 2048, 9
ROWS = (1, 16, 64, 1024, 8192)

# The kernel as it was (commit e6c047f), for the comparison; compiled after fused.cu's helpers.
OLD_NORM = r"""
__device__ float block_sum_old(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < nw ? red[lane] : 0.f;
    s = warp_sum(s);
    if (lane == 0) red[32] = s;
  }
  __syncthreads();
  return red[32];
}
extern "C" __global__ void rmsnorm_rows_old(const float* x, const float* __restrict__ y, int ny,
                                            const float* __restrict__ sg, long long sg_stride,
                                            const float* __restrict__ w, float* x_out, T* __restrict__ h,
                                            const int* __restrict__ rows, int n, int H, float eps) {
  pdl_enter();
  __shared__ float red[33];
  const int r = blockIdx.x;
  if (r >= n) return;
  const int s = rows ? rows[r] : r;
  const float* xs = x + (size_t)s * H;
  const float* ys = y ? y + (size_t)s * ny * H : nullptr;
  const float gate = sg ? sigmoidf_(sg[(size_t)s * sg_stride]) : 1.f;
  float* xo = x_out ? x_out + (size_t)r * H : nullptr;
  float ss = 0.f;
  for (int c = threadIdx.x; c < H; c += blockDim.x) {
    float v = xs[c];
#pragma unroll 4
    for (int j = 0; j < ny; ++j) {
      const float yj = ys[(size_t)j * H + c];
      v += (sg && j == ny - 1) ? yj * gate : yj;
    }
    if (xo) xo[c] = v;
    ss += v * v;
  }
  if (!h) return;
  const float tot = block_sum_old(ss, red);
  const float rs = rsqrtf(tot / (float)H + eps);
  const float* src = xo ? xo : xs;
  for (int c = threadIdx.x; c < H; c += blockDim.x) h[(size_t)r * H + c] = from_f32(src[c] * rs * w[c]);
}
"""


def old_module(arch: str) -> Any:
    from hybrid_runtime.cuda.kernels import Module, compile_cubin, source

    src = source("fused.cu")
    head = src[:src.index("// (add +) rmsnorm.")]
    head = head[:head.rindex("// ----")]
    return Module(compile_cubin(head + OLD_NORM, "fused_old_norm.cu", ("-DDT=2",), arch), "fused_old_norm")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/results/gpu_norm_h200.md")
    args = ap.parse_args()
    import torch

    from hybrid_runtime.cuda.backend import norm_block
    from hybrid_runtime.cuda.driver import CudaDevice
    from hybrid_runtime.cuda.kernels import load_module

    torch.cuda.init()
    bw = measure_copy_bandwidth(torch, CudaDevice(0, stream=0))
    dev = CudaDevice(0)
    new = load_module("fused.cu", ("-DDT=2",), dev.arch)
    old = old_module(dev.arch)
    n_max = max(ROWS)
    x = torch.randn(n_max, H, device="cuda")
    y32 = torch.randn(n_max, NY, H, device="cuda")
    y16 = y32.to(torch.bfloat16)
    sg = torch.randn(n_max, 8, device="cuda")
    w = torch.ones(H, device="cuda")
    h = torch.empty(n_max, H, device="cuda", dtype=torch.bfloat16)

    def call(mod: Any, entry: str, n: int, threads: int, ys: Any, slots: int) -> Any:
        def fn(i: int) -> None:
            mod.kernel(entry).launch(dev, (n, 1, 1), (threads, 1, 1), 0,
                                     [("ptr", x.data_ptr()), ("ptr", ys.data_ptr() if slots else 0),
                                      ("i32", slots), ("ptr", sg.data_ptr() + 12 if slots else 0), ("i64", 8),
                                      ("ptr", w.data_ptr()), ("ptr", x.data_ptr()), ("ptr", h.data_ptr()),
                                      ("ptr", 0), ("i32", n), ("i32", H), ("f32", 1e-6)], pdl=True)
        return fn

    def cell(fn: Any, n: int, slot_bytes: int, slots: int) -> str:
        t = time_on_stream(dev, fn, 20 if n >= 1024 else 200)
        moved = n * H * (4 + 4 + 2 + slots * slot_bytes)
        return f"{t * 1e6:.1f} ({moved / t / 1e12:.2f})"

    lines = [f"# add + RMSNorm, H {H} ({torch.cuda.get_device_name(0)})", "",
             f"`python3 -m benchmarks.gpu_norm`; copy bandwidth in this run {bw / 1e12:.2f} TB/s. Cells: us per call "
             "(effective TB/s).", "",
             "| rows | case | before: 1024 thr, float32 slots | rmsnorm_rows, float32 slots "
             "| rmsnorm_rows_t, bf16 slots | new block |", "|---|---|---|---|---|---|"]
    for n in ROWS:
        p, _ = norm_block(H, n)
        for label, slots in ((f"x + {NY} slots (last gated)", NY), ("x only (rmsnorm)", 0)):
            cells = [cell(call(old, "rmsnorm_rows_old", n, 1024, y32, slots), n, 4, slots),
                     cell(call(new, "rmsnorm_rows", n, p, y32, slots), n, 4, slots),
                     cell(call(new, "rmsnorm_rows_t", n, p, y16, slots), n, 2, slots) if slots else "—"]
            lines.append(f"| {n} | {label} | " + " | ".join(cells) + f" | {p} |")
            log(lines[-1])
    lines += ["", f"## rmsnorm_rows_t (bf16 slots, x + {NY}) by block size", "",
              "| rows | 128 | 256 | 512 |", "|---|---|---|---|"]
    for n in (1, 16, 8192):
        lines.append(f"| {n} | " + " | ".join(cell(call(new, "rmsnorm_rows_t", n, p, y16, NY), n, 2, NY)
                                               for p in (128, 256, 512)) + " |")
        log(lines[-1])
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
