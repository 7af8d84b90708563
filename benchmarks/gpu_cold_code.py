"""What a kernel of the decode step loses when its code is cold, as it is in the step (issue 15, device script).

    python3 -m benchmarks.gpu_cold_code [--out benchmarks/results/gpu_cold_code_h100.md]

In a captured decode step about ten other kernels run between two launches of one layer's GEMM and the step's
weights stream through L2, so every launch fetches its code cold; a microbenchmark that launches one kernel back to
back runs it hot. Per kernel (Qwen3.5-35B-A3B shapes, bf16, one token row): the time per call back to back ("hot")
and right after a kernel that evicts the SMs' instruction caches ("cold", ``gpu_common.cold_graph_seconds``), both
from captured graphs (no host time). The evictor does not trigger its successor early, so "cold" also exposes
what the step hides under the previous kernel when the cold code runs before griddepcontrol.wait (dense_decode's
prologue); code after the wait (the router's last CTA) pays it in the step too. Kernels: the fused MoE router at 1 and 8
tokens, and every dense_decode build on the three decode projections (weights rotated over > 4x the L2 so that
they come from memory in both columns). Under a minute.
"""

# ruff: noqa: B023 - every closure below is timed inside the loop iteration that defines it
from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from benchmarks.gpu_common import cold_graph_seconds, log, write_report
from benchmarks.gpu_moe_router import E_PAD, LAYERS, E, H, K

SHAPES = [("in_proj (GDN)", 12352, 2048), ("qkv_proj", 9216, 2048), ("out_proj / o_proj", 2048, 4096)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/gpu_cold_code_h100.md")
    ap.add_argument("--reps", type=int, default=5, help="graph replays per figure")
    args = ap.parse_args()
    import torch

    from hybrid_runtime.cuda.backend import fill_random
    from hybrid_runtime.cuda.dense_decode import KNOB_SETS, TUNE_SETS, DenseDecode
    from hybrid_runtime.cuda.driver import CudaDevice, DeviceArray, graph_replay_seconds
    from hybrid_runtime.cuda.kernels import load_module
    from hybrid_runtime.cuda.moe_router import MoERouter, RouteBuffers

    torch.cuda.init()
    dev = CudaDevice(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size

    def hot_cold(calls: list[Any]) -> tuple[float, float]:
        def body() -> None:
            for c in calls:
                c()

        body()
        hot = graph_replay_seconds(dev, body, args.reps) / len(calls)
        return hot * 1e6, cold_graph_seconds(dev, calls, args.reps) * 1e6

    rows: list[tuple[str, str, float, float]] = []
    fused = load_module("fused.cu", ("-DDT=2",), dev.arch)
    mats = []
    for i in range(LAYERS):  # one router matrix per layer: 43 MB
        w = dev.zeros((E_PAD, H), "bfloat16")
        fill_random(dev, fused, DeviceArray(w.ptr, (E + 1, H), "bfloat16", dev.ordinal), 100 + i, 1.0 / np.sqrt(H))
        mats.append(w)
    h = dev.empty((16, H), "bfloat16")
    fill_random(dev, fused, h, 7, 1.0)
    P = 16 * (K + 1)
    b = {n: dev.empty(s, d) for n, s, d in (("logits", (16, E_PAD), "float32"), ("pw", (P,), "float32"),
                                              ("pe", (P,), "int32"), ("pl", (P,), "int32"),
                                              ("off", (E + 2,), "int32"), ("active", (E + 2,), "int32"))}
    ws = dev.zeros((4,), "int32")
    bufs = RouteBuffers(b["pw"].ptr, b["pe"].ptr, b["off"].ptr, b["pl"].ptr, b["active"].ptr, ws.ptr)
    router = MoERouter(dev, "bfloat16", 8)
    for n in (1, 8):
        calls = [lambda w=w: router.launch(n, h.ptr, H, w, b["logits"].ptr, E_PAD, E, K, True, True, bufs)
                 for w in mats]
        hot, cold = hot_cold(calls)
        rows.append(("moe_router_route (rows 8)", f"{n} token(s)", hot, cold))
        log(rows[-1])

    names = ["default", *[k for k in TUNE_SETS if k != "default"]]
    kerns = {k: DenseDecode(dev, "bfloat16", KNOB_SETS[k]) for k in names}
    for label, N, Kd in SHAPES:
        wb = N * Kd * 2
        copies = max(8, -(-4 * l2 // wb))
        wts = [torch.randn(N, Kd, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, Kd, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, N, device="cuda", dtype=torch.float32)
        for name, kern in kerns.items():
            calls = [lambda w=w, kern=kern: kern.launch(1, x.data_ptr(), Kd, w.data_ptr(), N, Kd, y.data_ptr(), N,
                                                          True) for w in wts]
            hot, cold = hot_cold(calls)
            rows.append((f"dense_decode {name}", f"{label} {N}x{Kd}", hot, cold))
            log(rows[-1])
        del wts
        torch.cuda.empty_cache()

    lines = [f"# Kernels of the decode step with their code hot and cold ({torch.cuda.get_device_name(0)})", "",
             "`python3 -m benchmarks.gpu_cold_code`: us per call from captured graphs, back to back (hot) and each "
             "call right after `icache_evict.cu` (cold; no early start of the timed kernel under it); "
             "bf16, one token row unless said; weights rotated so that they come from memory in both columns.", "",
             "| kernel | shape | hot (us) | cold (us) | cold - hot |", "|---|---|---:|---:|---:|"]
    lines += [f"| {k} | {s} | {hot:.2f} | {cold:.2f} | {cold - hot:+.2f} |" for k, s, hot, cold in rows]
    for label, _, _ in SHAPES:
        mine = [r for r in rows if r[1].startswith(label)]
        if mine:
            bh, bc = min(mine, key=lambda r: r[2]), min(mine, key=lambda r: r[3])
            lines.append(f"\n{label}: fastest hot {bh[0]} ({bh[2]:.2f} us; cold {bh[3]:.2f}), fastest cold {bc[0]} "
                         f"({bc[3]:.2f} us)")
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
