"""The decode projections of the Qwen3.5-35B-A3B shape on ``dense_decode.cu`` (each build of
``cuda/dense_decode.KNOB_SETS``) against cuBLASLt, against the copy bandwidth measured in the same run.

    python3 -m benchmarks.gpu_dense_decode --out benchmarks/results/gpu_dense_decode_h200.md

Two measurements per shape and row count, both queue-filled (gpu_common.time_on_stream) over enough weight copies
to exceed 4x the L2:

* alone: back-to-back calls of the GEMM;
* after a norm: each call preceded by fused.cu's ``rmsnorm_rows`` of the same rows (x + 9 MoE slots), as in a decode
  step, where the GEMM reads the norm's output. cuBLASLt's kernel waits for the norm to finish before it starts;
  dense_decode's is a programmatic dependent that streams its first weights while the norm runs. The cell is the
  pair's time minus the norm's time alone, i.e. what the GEMM adds to the chain.

Cells: microseconds (effective TB/s of the weight bytes).
"""

# ruff: noqa: B023 - every closure below is timed (called) inside the loop iteration that defines it
from __future__ import annotations

import argparse
import math
from typing import Any

from benchmarks.gpu_common import log, measure_copy_bandwidth, time_on_stream, write_report

SHAPES = [("in_proj (GDN)", 12352, 2048), ("qkv_proj", 9216, 2048), ("out_proj / o_proj", 2048, 4096),
          ("lm_head", 248320, 2048)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/gpu_dense_decode_h200.md")
    ap.add_argument("--rows", default="1,8,16")
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    import torch

    from hybrid_runtime.cuda.blas import Blas
    from hybrid_runtime.cuda.dense_decode import KNOB_SETS, DenseDecode
    from hybrid_runtime.cuda.driver import CudaDevice
    from hybrid_runtime.cuda.kernels import load_module

    torch.cuda.init()
    dev0 = CudaDevice(0, stream=0)
    bw = measure_copy_bandwidth(torch, dev0)
    dev = CudaDevice(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    blas = Blas(dev)
    fused = load_module("fused.cu", ("-DDT=2",), dev.arch)
    kerns = {name: DenseDecode(dev, "bfloat16", kn) for name, kn in KNOB_SETS.items()}
    H = 2048
    lines = [f"# Dense decode GEMMs on the 35B-A3B shapes ({torch.cuda.get_device_name(0)})", "",
             f"`python3 -m benchmarks.gpu_dense_decode`; copy bandwidth in this run {bw / 1e12:.2f} TB/s. Cells: "
             "microseconds per call (effective TB/s of the weight bytes). Builds: " +
             "; ".join(f"{n} = {kn}" for n, kn in KNOB_SETS.items()) + ".", ""]
    head = "| shape | rows | bytes (MB) | floor (us) | " + " | ".join(f"dd {n}" for n in kerns) + \
        " | cuBLASLt | dd default after a norm | cuBLASLt after a norm | norm alone |"
    lines += [head, "|" + "---|" * (8 + len(kerns))]
    for name, N, K in SHAPES:
        wb = N * K * 2
        copies = int(min(16, max(1, math.ceil(4 * l2 / wb))))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for M in rows_list:
            xs = torch.randn(M, max(K, H), device="cuda", dtype=torch.bfloat16)
            y = torch.empty(M, N, device="cuda", dtype=torch.float32)
            nx = torch.randn(M, H, device="cuda", dtype=torch.float32)
            ny = torch.randn(M, 9, H, device="cuda", dtype=torch.float32)
            nw = torch.ones(H, device="cuda", dtype=torch.float32)
            ldx = xs.shape[1]

            def norm() -> None:  # writes x's first H columns (bf16): the GEMM's input
                fused.kernel("rmsnorm_rows").launch(
                    dev, (M, 1, 1), (1024, 1, 1), 0,
                    [("ptr", nx.data_ptr()), ("ptr", ny.data_ptr()), ("i32", 9), ("ptr", 0), ("i64", 0),
                     ("ptr", nw.data_ptr()), ("ptr", 0), ("ptr", xs.data_ptr()), ("ptr", 0), ("i32", M), ("i32", H),
                     ("f32", 1e-6)], pdl=True)

            def dd(i: int, kern: Any) -> None:
                kern.launch(M, xs.data_ptr(), ldx, ws[i % copies].data_ptr(), N, K, y.data_ptr(), N, True)

            def cub(i: int) -> None:
                blas.gemm(M, N, K, xs.data_ptr(), ws[i % copies].data_ptr(), y.data_ptr(), dtype="bfloat16",
                          out_dtype="float32", ldx=ldx)

            cells = []
            for kern in kerns.values():
                t = time_on_stream(dev, lambda i, kern=kern: dd(i, kern), 40)
                cells.append(f"{t * 1e6:.1f} ({wb / t / 1e12:.2f})")
            t_cub = time_on_stream(dev, cub, 40)
            t_norm = time_on_stream(dev, lambda i: norm(), 40)
            t_dd_chain = time_on_stream(dev, lambda i: (norm(), dd(i, kerns["default"])), 40) - t_norm
            t_cub_chain = time_on_stream(dev, lambda i: (norm(), cub(i)), 40) - t_norm
            lines.append(f"| {name} | {M} | {wb / 1e6:.1f} | {wb / bw * 1e6:.1f} | " + " | ".join(cells) +
                         f" | {t_cub * 1e6:.1f} ({wb / t_cub / 1e12:.2f}) | {t_dd_chain * 1e6:.1f} "
                         f"({wb / t_dd_chain / 1e12:.2f}) | {t_cub_chain * 1e6:.1f} ({wb / t_cub_chain / 1e12:.2f}) | "
                         f"{t_norm * 1e6:.1f} |")
            log(lines[-1])
        ws.clear()
        torch.cuda.empty_cache()
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
