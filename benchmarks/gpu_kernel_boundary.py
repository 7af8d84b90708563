"""What a kernel boundary costs a weight-streaming decode GEMM in a programmatic-dependent chain (issue 15: is a
persistent kernel worth it at batch 1?), against the copy bandwidth measured in the same run.

    python3 -m benchmarks.gpu_kernel_boundary [--rows 1 8] [--out FILE]

For a decode projection shape (N x K bf16 weights, ``dense_decode.cu``'s default build, ``n`` token rows), ``M``
weight matrices that together exceed 4x the L2 are read two ways, each captured in one CUDA graph and replayed
(CUDA events, no host work):

* chain: ``M`` launches, one per matrix, back to back as a decode step chains its kernels (each a programmatic
  dependent of the one before: its first weight loads go out before it waits);
* one launch: the same ``M`` matrices stacked as one ``M N x K`` product, a single grid streaming the same bytes.

Both read the same bytes and do the same arithmetic per output row, so the difference per launch is what a kernel
boundary costs in the chain (the ramp of a grid plus its tail, net of what PDL already overlaps): the most a
scheduler inside one kernel could recover per boundary, before its own synchronisation costs.

Written at stop 46 and not yet run on a device (the session's device time ran out): its first run is its test.
"""

# ruff: noqa: B023 - every closure below is timed (called) inside the loop iteration that defines it
from __future__ import annotations

import argparse
import datetime
import math
from typing import Any

from benchmarks.gpu_common import log, measure_copy_bandwidth, time_graph, write_report

SHAPES = [("out_proj / o_proj", 2048, 4096), ("in_proj (GDN)", 12352, 2048), ("qkv_proj", 9216, 2048),
          ("expert-sized: 1024 x 2048", 1024, 2048)]
CALLS = 4  # graph nodes per replay, in units of "all M matrices once"


def shape_rows(torch: Any, dev: Any, dd: Any, bw: float, l2: int, name: str, N: int, K: int,
               rows: list[int]) -> list[str]:
    """The table rows of one shape: chain vs one stacked launch at each row count."""
    wb = N * K * 2
    M = max(4, math.ceil(4 * l2 / wb))
    w = torch.randn(M * N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    out = []
    for n in rows:
        x = torch.randn(n, K, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(n, M * N, device="cuda", dtype=torch.float32)

        def chain(i: int) -> None:  # matrix i % M into its own columns of y
            j = i % M
            dd.launch(n, x.data_ptr(), K, w.data_ptr() + j * wb, N, K, y.data_ptr() + 4 * j * N, M * N, True)

        def stacked(i: int) -> None:
            dd.launch(n, x.data_ptr(), K, w.data_ptr(), M * N, K, y.data_ptr(), M * N, True)

        t_chain = time_graph(dev, chain, CALLS * M)  # per launch = per matrix
        t_stack = time_graph(dev, stacked, CALLS) / M  # per matrix
        floor = wb / bw
        out.append(f"| {name} | {n} | {M} | {wb / 1e6:.1f} | {floor * 1e6:.2f} | {t_chain * 1e6:.2f} | "
                   f"{t_chain / floor:.2f} | {t_stack * 1e6:.2f} | {t_stack / floor:.2f} | "
                   f"{(t_chain - t_stack) * 1e6:.2f} |")
        log(out[-1])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--out", default="/tmp/gpu_kernel_boundary.md")
    args = ap.parse_args(argv)
    if min(args.rows) < 1 or max(args.rows) > 16:
        ap.error("--rows: 1 .. 16 (dense_decode's decode range)")
    import torch

    from hybrid_runtime.cuda.dense_decode import DenseDecode
    from hybrid_runtime.cuda.driver import CudaDevice

    torch.cuda.init()
    bw = measure_copy_bandwidth(torch, CudaDevice(0, stream=0))
    dev = CudaDevice(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    dd = DenseDecode(dev, "bfloat16")
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s, L2 {l2 / 2**20:.0f} MiB")
    lines = [f"# A kernel boundary in a decode GEMM chain ({datetime.date.today()})", "",
             f"`python3 -m benchmarks.gpu_kernel_boundary --rows {' '.join(map(str, args.rows))}` on "
             f"{torch.cuda.get_device_name(0)}; copy bandwidth measured in this run {bw / 1e12:.2f} TB/s; "
             f"dense_decode default build {dd.knobs}. Per matrix, us.", "",
             "| shape | rows | matrices | MB each | floor | chain: one launch each | x floor | one stacked launch | "
             "x floor | boundary cost (chain - stacked) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, N, K in SHAPES:
        lines += shape_rows(torch, dev, dd, bw, l2, name, N, K, args.rows)
        torch.cuda.empty_cache()
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
