"""The prefill MoE's grouped GEMMs on packed experts (``MoEPrefill.experts_packed``: each weight tile dequantised in
shared memory) against dequantising the stacks first (what a packed layer ran before: ``nbits_dequant8`` of both
stacks, then the ``"wgmma_ws"`` GEMMs) and against bf16 stacks, one MoE layer of the Qwen3.5-35B-A3B shape.

    python3 -m benchmarks.gpu_moe_prefill_packed --tokens 1024,8192 --bits 4,8 \\
        --out benchmarks/results/gpu_moe_prefill_packed_h200.md

Layer: H 2048, I 512, 256 routed experts + the shared one stacked as expert 256 (the packed layout a GPTQ bundle
loads, group 128, symmetric, random codes; not folded in prefill), top-8 of random router logits; bf16 activations.
Routing runs once per case (not timed); timed: the two GEMMs (gate_up + down, y in bf16 as the backend's prefill
steps write it), back to back between CUDA events, median of 3 runs. Floor: the bytes the GEMMs must read (the
active experts' weights as stored: codes + scales, or bf16) over the copy bandwidth measured in this run, and the
matmul time at the bf16 matmul rate measured in this run (8192^3 torch.matmul); x floor = time / max of the two.
"""

from __future__ import annotations

import argparse
import datetime

import numpy as np

from benchmarks.gpu_common import log, measure_copy_bandwidth, time_on_stream, write_report

H, I, E, K_TOP = 2048, 512, 256, 8


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1024,8192")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    import torch

    from benchmarks.gpu_prefill import matmul_rate
    from hybrid_runtime.cuda.backend import fill_random, fill_random_codes
    from hybrid_runtime.cuda.driver import CudaDevice, DeviceArray
    from hybrid_runtime.cuda.kernels import load_module
    from hybrid_runtime.cuda.moe_prefill import ROUTE_MAX_CTAS, MoEBuffers, MoEPrefill, tile_list_words
    from hybrid_runtime.cuda.quant import NBitsDequant, PackedLinear

    torch.cuda.init()
    dev = CudaDevice(0)
    bw = measure_copy_bandwidth(torch, dev)
    peak = matmul_rate(torch)
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    fused = load_module("fused.cu", ("-DDT=2",), dev.arch)
    mp = MoEPrefill(dev, "bfloat16", impl="wgmma_ws")
    deq = NBitsDequant(dev, "bfloat16")
    e_all, bs = E + 1, a.group
    n_max = max(int(t) for t in a.tokens.split(","))
    P = n_max * K_TOP
    bufs_ = {name: dev.empty(shape, dt) for name, shape, dt in (
        ("pw", (P,), "float32"), ("pe", (P,), "int32"), ("pl", (P,), "int32"), ("off", (e_all + 1,), "int32"),
        ("active", (e_all + 1,), "int32"), ("tiles", (tile_list_words(P, e_all),), "int32"),
        ("cta", (ROUTE_MAX_CTAS, e_all), "int32"), ("act", (P, I), "bfloat16"), ("y", (n_max, K_TOP, H), "bfloat16"))}
    b = bufs_
    bufs = MoEBuffers(b["pw"].ptr, b["pe"].ptr, b["pl"].ptr, b["off"].ptr, b["active"].ptr, b["tiles"].ptr,
                      b["cta"].ptr, b["act"].ptr, b["y"].ptr, (b["tiles"].size - 4) // 4)
    stacks = {"gate_up": (2 * I, H), "down": (H, I)}
    wt = {kind: dev.empty((e_all, R, Kd), "bfloat16") for kind, (R, Kd) in stacks.items()}
    for i, w in enumerate(wt.values()):
        fill_random(dev, fused, w, 7 + i, 0.02)
    h = dev.empty((n_max, H), "bfloat16")
    fill_random(dev, fused, h, 3, 1.0)
    rng = np.random.default_rng(0)
    rows = []
    for bits in [int(x) for x in a.bits.split(",")]:
        packed = {}
        for kind, (R, Kd) in stacks.items():
            nb = Kd // bs
            raw = dev.empty((e_all * R * Kd * bits // 16,), "bfloat16")
            fill_random_codes(dev, fused, raw, 11 + bits, bits)  # uniform codes around the zero-point
            B = DeviceArray(raw.ptr, (e_all, R, nb, bs * bits // 8), "uint8", raw.device, owner=raw)
            sc = (rng.uniform(0.5, 1.5, (e_all, R * nb)) * 0.01).astype(np.float16).astype(np.float32)
            packed[kind] = PackedLinear(B, dev.upload(sc), None, None, Kd, R, bits, bs, Kd, e_all)
        for n in [int(t) for t in a.tokens.split(",")]:
            lg = dev.upload(rng.standard_normal((n, E + 8)).astype(np.float32))
            mp.route(n, lg.ptr, E + 8, E, K_TOP, True, bufs)
            dev.synchronize()
            active = int((np.diff(dev.download(b["off"])) > 0).sum())  # experts with pairs

            def bf16(_i: int, n: int = n) -> None:
                mp.experts(n, h.ptr, H, wt["gate_up"].ptr, wt["down"].ptr, H, I, K_TOP, K_TOP, e_all, bufs,
                           y_dtype="bfloat16")

            def deq_first(_i: int, n: int = n, packed: dict = packed) -> None:
                for kind, p in packed.items():
                    deq.launch(p, wt[kind].ptr, p.K, p.N * p.K)
                bf16(_i, n)

            def fused_packed(_i: int, n: int = n, packed: dict = packed) -> None:
                mp.experts_packed(n, h.ptr, H, packed["gate_up"], packed["down"], H, I, K_TOP, K_TOP, e_all, bufs,
                                  y_dtype="bfloat16")

            t = {name: time_on_stream(dev, fn, a.reps) for name, fn in
                 (("bf16", bf16), ("dequantise, then bf16", deq_first), ("packed", fused_packed))}
            per_expert = 3 * H * I
            flops = 2 * n * K_TOP * per_expert
            fl_t = flops / peak
            rd = {"bf16": active * per_expert * 2, "packed": active * per_expert * (bits / 8 + 4 / bs)}
            for name, sec in t.items():
                byts = rd["bf16" if name == "bf16" else "packed"]
                floor = max(byts / bw, fl_t)
                rows.append((bits, n, active, name, sec, floor, t["bf16"]))
                log(f"int{bits} n={n} active={active} {name}: {sec * 1e6:.1f} us ({sec / floor:.2f}x floor, "
                    f"{sec / t['bf16']:.2f}x bf16)")
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Prefill MoE GEMMs on packed experts, one Qwen3.5-35B-A3B layer ({dev.limits.name}, {when})", "",
             f"Command: `python3 -m benchmarks.gpu_moe_prefill_packed --tokens {a.tokens} --bits {a.bits} --group "
             f"{a.group}`; copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s measured in "
             "this run. Time: gate_up + down GEMMs (routing excluded), us.", "",
             "| bits | tokens | active experts | path | us | x floor | x bf16 |", "|---|---|---|---|---|---|---|"]
    for bits, n, active, name, sec, floor, ref in rows:
        lines.append(f"| {bits} | {n} | {active} | {name} | {sec * 1e6:.1f} | {sec / floor:.2f} | {sec / ref:.2f} |")
    if a.out:
        write_report(a.out, lines)
    else:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
