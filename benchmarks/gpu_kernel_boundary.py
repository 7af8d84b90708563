"""What a kernel boundary costs a weight-streaming decode GEMM in a programmatic-dependent chain (issue 15: is a
persistent kernel worth it at batch 1?), against the copy bandwidth measured in the same run.

    python3 -m benchmarks.gpu_kernel_boundary [--rows 1 8] [--out FILE]

For a decode projection shape (N x K bf16 weights, ``dense_decode.cu``'s default build, ``n`` token rows), ``M``
weight matrices that together exceed 4x the L2 are read several ways, each captured in one CUDA graph and replayed
(CUDA events, no host work):

* stacked: the ``M`` matrices as one ``M N x K`` product, a single grid streaming the same bytes (no boundary);
* chain: ``M`` launches, one per matrix, back to back as a decode step chains its kernels, each a programmatic
  dependent of the one before (its first weight loads go out before its ``griddepcontrol.wait``): today's step;
* chain, pf16: the same with the build that also prefetches 16 super-steps into L2 before the wait;
* chain, no PDL: plain stream order (a kernel starts when the one before has finished);
* chain, counter: programmatic launches whose CTAs wait for a counter in global memory instead (the kernel before
  adds 1 per CTA with release semantics after its stores; thread 0 spins with ``ld.acquire.gpu`` until it has
  reached ``i * CTAs``; ``DD_SYNC=2``): what a flag-based dependency (as a persistent kernel's) would cost;
* chain, no wait: programmatic launches that never wait (``DD_SYNC=1``; only a benchmark may: the matrices do not
  depend on each other here): the boundary's ramp and tail alone, without any synchronisation;
* chain, early trigger: ``griddepcontrol.launch_dependents`` at the kernel's entry (``DD_TRIGGER=1``);
* chain, 2 batches pre-wait / u8 / u8, 2 batches pre-wait: more of a warp's weights in registers before the wait
  (``DD_PREWAIT=2``, ``u`` 8);
* one launch, counter between products (and with u8, 2 batches before each wait): every product in ONE launch
  (``dd_gemm_m16_phases``), a grid-wide counter between them - what a persistent kernel pays per phase; run only
  where the grid fits one CTA per SM (the spin needs every CTA resident).

The builds that keep a wait are checked to give the default build's bits.

All read the same bytes and do the same arithmetic per output row, so a chain's excess over stacked per launch is
what a kernel boundary costs; the variants split it into synchronisation (wait vs counter vs none) and the grid's
ramp and tail (no wait vs stacked).

First run at stop 47 (2026-12-06, H100): ``benchmarks/results/gpu_kernel_boundary_h100.md``, read in
``benchmarks/results/gpu_decode_step_notes.md`` "Stop 47".
"""

# ruff: noqa: B023 - every closure below is timed (called) inside the loop iteration that defines it
from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
from typing import Any

from benchmarks.gpu_common import log, measure_copy_bandwidth, time_graph, write_report

SHAPES = [("out_proj / o_proj", 2048, 4096), ("in_proj (GDN)", 12352, 2048), ("qkv_proj", 9216, 2048),
          ("expert-sized: 1024 x 2048", 1024, 2048)]
CALLS = 4  # graph nodes per replay, in units of "all M matrices once"
VARIANTS = ("stacked", "chain", "chain pf16", "chain no PDL", "chain counter", "chain early trigger",
            "chain 2 batches pre-wait", "chain u8", "chain u8, 2 batches pre-wait", "chain no wait",
            "one launch, counter between products", "one launch, u8, 2 batches before each wait")
# benchmark-only builds of dense_decode.cu: (u, extra defines) on the default's rows and k per warp
BUILDS = {"chain counter": (4, ("-DDD_SYNC=2",)), "chain early trigger": (4, ("-DDD_TRIGGER=1",)),
          "chain 2 batches pre-wait": (4, ("-DDD_PREWAIT=2",)), "chain u8": (8, ()),
          "chain u8, 2 batches pre-wait": (8, ("-DDD_PREWAIT=2",)), "chain no wait": (4, ("-DDD_SYNC=1",)),
          "counter u8 p2": (8, ("-DDD_SYNC=2", "-DDD_PREWAIT=2"))}


def shape_rows(torch: Any, dev: Any, dd: Any, sync_mods: dict[str, Any], bw: float, l2: int, sms: int, name: str,
               N: int, K: int, rows: list[int]) -> list[str]:
    """The table rows of one shape: per variant, us per matrix at each row count."""
    from hybrid_runtime.cuda.dense_decode import KNOB_SETS, grid, warps_for

    kn = dd.knobs
    wb = N * K * 2
    M = max(4, math.ceil(4 * l2 / wb))
    w = torch.randn(M * N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    ctr = torch.zeros(4, device="cuda", dtype=torch.int32)
    g, block = grid(N, kn), (32 * warps_for(K, kn), 1, 1)
    out = []
    for n in rows:
        x = torch.randn(n, K, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(n, M * N, device="cuda", dtype=torch.float32)

        def args(i: int) -> list[tuple[str, Any]]:
            j = i % M
            return [("ptr", x.data_ptr()), ("i64", K), ("ptr", w.data_ptr() + j * wb), ("i32", N), ("i32", K),
                    ("i32", n), ("ptr", 0), ("ptr", 0), ("i64", 0), ("ptr", y.data_ptr() + 4 * j * N),
                    ("i64", M * N), ("i32", 1)]

        def chain(i: int, knobs: Any = kn) -> None:  # matrix i % M into its own columns of y
            j = i % M
            dd.launch(n, x.data_ptr(), K, w.data_ptr() + j * wb, N, K, y.data_ptr() + 4 * j * N, M * N, True,
                      knobs=knobs)

        def no_pdl(i: int) -> None:
            dd.modules[kn].kernel(kn.kernel).launch(dev, g, block, 0, args(i), pdl=False)

        def variant(i: int, build: str) -> None:
            extra: list[tuple[str, Any]] = []
            if "counter" in build:  # the counter's target: i launches of g[0] CTAs before this one
                if i == 0:
                    dev.memset_d32(ctr.data_ptr(), 0, 1)
                extra = [("ptr", ctr.data_ptr()), ("u32", i * g[0])]
            sync_mods[build].kernel(kn.kernel).launch(dev, g, block, 0, [*args(i), *extra], pdl=True)

        def stacked(i: int) -> None:
            dd.launch(n, x.data_ptr(), K, w.data_ptr(), M * N, K, y.data_ptr(), M * N, True)

        t = {"stacked": time_graph(dev, stacked, CALLS) / M,  # per matrix
             "chain": time_graph(dev, chain, CALLS * M),  # per launch = per matrix
             "chain pf16": time_graph(dev, lambda i: chain(i, KNOB_SETS["pf16"]), CALLS * M),
             "chain no PDL": time_graph(dev, no_pdl, CALLS * M),
             **{b: time_graph(dev, lambda i: variant(i, b), CALLS * M) for b in BUILDS if b in VARIANTS}}
        chain(0)  # the builds that keep the wait must give today's bits (matrix 0's columns of y)
        ref = y[:, :N].clone()
        for b in ("chain early trigger", "chain 2 batches pre-wait", "chain u8", "chain u8, 2 batches pre-wait"):
            y.zero_()
            variant(0, b)
            torch.cuda.synchronize()
            if not torch.equal(y[:, :N], ref):
                raise SystemExit(f"{b}: not the default build's bits ({name}, {n} rows)")

        def phases(i: int, build: str = "chain counter") -> None:  # all M products in one launch, by the counter
            dev.memset_d32(ctr.data_ptr(), 0, 1)
            sync_mods[build].kernel("dd_gemm_m16_phases").launch(
                dev, g, block, 0, [("ptr", x.data_ptr()), ("i64", K), ("ptr", w.data_ptr()), ("i32", N), ("i32", K),
                                   ("i32", n), ("ptr", y.data_ptr()), ("i64", M * N), ("i32", M),
                                   ("ptr", ctr.data_ptr())], pdl=False)

        # co-residency of every CTA is what keeps the spin from deadlocking: one CTA per SM at most
        for v, b in (("one launch, counter between products", "chain counter"),
                     ("one launch, u8, 2 batches before each wait", "counter u8 p2")):
            t[v] = float("nan")
            if g[0] <= sms:
                y.zero_()
                phases(0, b)
                torch.cuda.synchronize()
                if not torch.equal(y[:, :N], ref):
                    raise SystemExit(f"{v}: not the default build's bits ({name}, {n} rows)")
                t[v] = time_graph(dev, lambda i: phases(i, b), CALLS) / M
        floor = wb / bw
        cells = " | ".join(f"{t[v] * 1e6:.2f} ({t[v] / floor:.2f}x)" for v in VARIANTS)
        excess = " / ".join(f"{(t[v] - t['stacked']) * 1e6:.2f}" for v in VARIANTS[1:])
        out.append(f"| {name} | {n} | {M} | {wb / 1e6:.1f} | {floor * 1e6:.2f} | {cells} | {excess} |")
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

    from hybrid_runtime.cuda.dense_decode import KNOB_SETS, SOURCE, DenseDecode
    from hybrid_runtime.cuda.driver import CudaDevice
    from hybrid_runtime.cuda.kernels import load_module

    torch.cuda.init()
    bw = measure_copy_bandwidth(torch, CudaDevice(0, stream=0))
    dev = CudaDevice(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dd = DenseDecode(dev, "bfloat16", candidates=[KNOB_SETS["pf16"]])
    sync_mods = {b: load_module(SOURCE, ("-DDT=2", *dataclasses.replace(dd.knobs, u=u).options, *o), dev.arch)
                 for b, (u, o) in BUILDS.items()}
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s, L2 {l2 / 2**20:.0f} MiB")
    lines = [f"# A kernel boundary in a decode GEMM chain ({datetime.date.today()})", "",
             f"`python3 -m benchmarks.gpu_kernel_boundary --rows {' '.join(map(str, args.rows))}` on "
             f"{torch.cuda.get_device_name(0)}; copy bandwidth measured in this run {bw / 1e12:.2f} TB/s; "
             f"dense_decode default build {dd.knobs}. Per matrix, us.", "",
             "| shape | rows | matrices | MB each | floor | " + " | ".join(VARIANTS)
             + " | each chain - stacked |", "|---" * (6 + len(VARIANTS)) + "|"]
    for name, N, K in SHAPES:
        lines += shape_rows(torch, dev, dd, sync_mods, bw, l2, sms, name, N, K, args.rows)
        torch.cuda.empty_cache()
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
