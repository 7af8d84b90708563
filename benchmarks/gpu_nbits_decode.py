"""The int4 / int8 decode GEMM (``cuda/nbits_decode.py``) on the Qwen3.5-35B-A3B decode layers against its floor
(the packed codes + scales (+ zero-points) read once, over the copy bandwidth measured in the same run) and against
the bf16 ``dense_decode`` GEMM of the same shape.

    python3 -m benchmarks.gpu_nbits_decode --out benchmarks/results/gpu_nbits_decode_h200.md

Every call rotates over enough weight copies to exceed 4x the L2, so the weights come from HBM as in a decode step.
Cells: microseconds per call; ratio = time / floor. The build and dense_decode cells are GPU time alone: the calls
(``--calls``, back to back) are captured once in a CUDA graph and its replay timed with events
(gpu_common.time_graph), as a decode step is served. Two more columns show what the earlier version of this
benchmark measured: the default build queue-filled (gpu_common.time_on_stream, ``--queue-calls`` eager launches
behind a ~10 ms spin), and the host's cost of one eager launch (nbits / dense_decode; gpu_common.host_seconds_per_call):
when ``calls`` x that cost outlasts the spin, the queue-filled figure is (host time - spin) / calls, not the kernel.
One column per build of ``nbits_decode.KNOB_SETS`` (default: 4-bit dequantised in packed bf16 arithmetic, 256 row
bytes per warp; exact: in float32, rounded once; u1: one super-step per register batch; m32: 32 weight rows per CTA;
xpre: a register batch's activations loaded at its top; pf8: 8 more super-steps of a warp's share prefetched into L2
before the programmatic wait; bpw128 / bpw512: 128 / 512 row bytes per warp, twice / half
as many warps: other sums, the others but exact give the default's bits).
"""

# ruff: noqa: B023 - every closure below is timed (called) inside the loop iteration that defines it
from __future__ import annotations

import argparse
import math

from benchmarks.gpu_common import (
    host_seconds_per_call,
    log,
    measure_copy_bandwidth,
    time_graph,
    time_on_stream,
    write_report,
)

SHAPES = [("GDN in_proj", 2048, 12288), ("2048 x 64", 2048, 64), ("out_proj / o_proj", 4096, 2048),
          ("attention qkv", 2048, 9216), ("expert gate_up", 2048, 1024), ("expert down", 512, 2048)]  # (K, N)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/gpu_nbits_decode_h200.md")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--group", type=int, default=128, help="block size (-1: one block per row)")
    ap.add_argument("--asym", action="store_true", help="with zero-points (default: symmetric GPTQ, none stored)")
    ap.add_argument("--perm", action="store_true", help="act order: a random permutation (the _perm kernels)")
    ap.add_argument("--calls", type=int, default=64, help="calls per timed graph")
    ap.add_argument("--queue-calls", type=int, default=200,
                    help="eager calls per queue-filled run of the default build (200: the earlier method)")
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    import torch

    from hybrid_runtime.cuda.dense_decode import DenseDecode
    from hybrid_runtime.cuda.driver import CudaDevice
    from hybrid_runtime.cuda.nbits_decode import (
        BACKEND_KNOBS,
        KNOB_SETS,
        NBitsDecode,
        NBitsOperand,
        build_name,
        tune_candidates,
        warps_for,
    )

    torch.cuda.init()
    dev0 = CudaDevice(0, stream=0)
    bw = measure_copy_bandwidth(torch, dev0)
    dev = CudaDevice(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    kerns = {name: NBitsDecode(dev, "bfloat16", kn) for name, kn in KNOB_SETS.items()}
    by_knobs = {kn: kerns[name] for name, kn in KNOB_SETS.items()}  # + the backend's tuning candidates, as met
    dense = DenseDecode(dev, "bfloat16")
    lines = [f"# int4 / int8 decode GEMMs on the 35B-A3B shapes ({torch.cuda.get_device_name(0)})", "",
             f"`python3 -m benchmarks.gpu_nbits_decode --group {args.group} --bits {args.bits} --rows {args.rows}"
             f"{' --asym' if args.asym else ''}"
             f"{' --perm' if args.perm else ''}`; bf16 "
             f"activations; copy bandwidth in this run {bw / 1e12:.2f} TB/s. Floor = the bytes one call reads (packed "
             "codes + float32 scales" + (" + zero-points" if args.asym else "") + (" + perm" if args.perm else "") +
             f") / copy bandwidth. Cells: microseconds per call (time / floor), GPU time of {args.calls} calls "
             f"replayed from a CUDA graph; 'default queue-filled': {args.queue_calls} eager launches of the default "
             "build behind a ~10 ms spin (the earlier method: host-bound when they outlast the spin); 'host us / "
             "launch': one eager launch's host cost, nbits / dense_decode; 'tuned': the fastest of the builds "
             "CudaBackend's NBitsDecode.tune chooses among at load (tune_candidates(BACKEND_KNOBS), resolved for the "
             "operand's bits and block size: the backend build's bits), against the floor and against "
             "dense_decode's time. Builds: " +
             "; ".join(f"{n} = {kn}" for n, kn in KNOB_SETS.items()) + ".", ""]
    lines += ["| layer | K x N | bits | rows | warps | MB read | floor (us) | " +
              " | ".join(f"nbits {n}" for n in kerns) + " | tuned (vs floor, vs dense) | "
              "bf16 dense_decode (its floor) | default queue-filled | host us / launch |",
              "|" + "---|" * (11 + len(kerns))]
    for name, K, N in SHAPES:
        for bits in (int(b) for b in args.bits.split(",")):
            bs = K if args.group == -1 else args.group
            nb = K // bs
            perm = torch.randperm(K, device="cuda").to(torch.int32) if args.perm else None
            probe = NBitsOperand(16, 16, 16 if args.asym else 0, 16 if args.perm else 0, K, N, bits, bs, K)
            nbytes = probe.nbytes
            copies = int(min(16, max(1, math.ceil(4 * l2 / nbytes))))
            ws = []
            for _ in range(copies):
                B = torch.randint(0, 256, (N, K * bits // 8), device="cuda", dtype=torch.uint8)
                s = torch.rand(N, nb, device="cuda", dtype=torch.float32) * 0.01
                z = (torch.randint(0, 256, (N, (nb + 1) // 2 if bits == 4 else nb), device="cuda", dtype=torch.uint8)
                     if args.asym else None)
                ws.append((B, s, z, NBitsOperand(B.data_ptr(), s.data_ptr(), z.data_ptr() if z is not None else 0,
                                                 perm.data_ptr() if perm is not None else 0, K, N, bits, bs, K)))
            dbytes = N * K * 2
            dcopies = int(min(16, max(1, math.ceil(4 * l2 / dbytes))))
            dws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(dcopies)]
            for M in rows_list:
                xs = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                y = torch.empty(M, N, device="cuda", dtype=torch.float32)
                cells, times = [], {}
                floor = nbytes / bw

                def timed(kern: NBitsDecode) -> float:
                    return time_graph(dev, lambda i: kern.launch(
                        M, xs.data_ptr(), K, ws[i % copies][3], y.data_ptr(), N, True), args.calls)

                for kname, kern in kerns.items():
                    times[KNOB_SETS[kname]] = t = timed(kern)
                    cells.append(f"{t * 1e6:.2f} ({t / floor:.2f}x)")
                tuned = {}
                for kn in dict.fromkeys(c.resolve(bits, bs) for c in tune_candidates(BACKEND_KNOBS)):
                    if kn not in times:
                        kern = by_knobs.setdefault(kn, NBitsDecode(dev, "bfloat16", kn))
                        times[kn] = timed(kern)
                    tuned[build_name(kn)] = times[kn]
                best = min(tuned, key=lambda k: tuned[k])  # what NBitsDecode.tune would keep (ties aside)

                def nb_call(i: int) -> None:
                    kerns["default"].launch(M, xs.data_ptr(), K, ws[i % copies][3], y.data_ptr(), N, True)

                def dd_call(i: int) -> None:
                    dense.launch(M, xs.data_ptr(), K, dws[i % dcopies].data_ptr(), N, K, y.data_ptr(), N, True)

                td = time_graph(dev, dd_call, args.calls)
                tq = time_on_stream(dev, nb_call, args.queue_calls)
                h_nb = host_seconds_per_call(dev, nb_call, args.calls)
                h_dd = host_seconds_per_call(dev, dd_call, args.calls)
                lines.append(f"| {name} | {K} x {N} | {bits} | {M} | {warps_for(K, bits)} | {nbytes / 1e6:.2f} | "
                             f"{floor * 1e6:.2f} | " + " | ".join(cells) +
                             f" | {best} {tuned[best] * 1e6:.2f} ({tuned[best] / floor:.2f}x, "
                             f"{tuned[best] / td:.2f}x dense)"
                             f" | {td * 1e6:.2f} ({td / (dbytes / bw):.2f}x) | {tq * 1e6:.2f} ({tq / floor:.2f}x) | "
                             f"{h_nb * 1e6:.0f} / {h_dd * 1e6:.0f} |")
                log(lines[-1])
            ws.clear()
            dws.clear()
            torch.cuda.empty_cache()
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
