"""A GDN layer's decode on the GPU, the three ways the ``cuda`` backend can run it, against the copy bandwidth
measured in the same run: one clustered launch (``gdn_decode_cluster``: 128-thread CTAs, clusters of 8;
``gdn_decode_cluster_head``: a CTA per value head, clusters of 2), the fused pair (``gdn_conv_gates_decode`` +
``gdn_decode_norm``), the four launches (``gdn_gates``, ``gdn_conv_decode``, ``gdn_decode``, ``gated_rmsnorm``).

    python3 -m benchmarks.gpu_gdn_decode [--batches 1 8 64] [--layers 30] [--out FILE]

Qwen3.5-35B-A3B's GDN layer (16 key / 32 value heads x 128, conv K = 4), the backend's build (float32 u, z, core;
o in bfloat16). ``--layers`` layers, each with a state cache of its own (``batch`` + 8 slots), are captured in one
CUDA graph back to back, as a decode step chains them (programmatic dependent launches between the kernels), and
replayed (CUDA events, no host work); the figure is the replay over the layer count. Floor = the state a layer's
step reads and writes (recurrent 2 MiB + conv window 96 KiB per row, both ways) + its u / z rows over the copy
bandwidth. The step's projections are not in the chain, so a kernel's latency hides only behind the GDN kernels
before it: an upper bound on what the path costs inside a step, where ``benchmarks.gpu_decode_step --fused-gdn
cluster,pair,off`` measures the whole step.
"""

from __future__ import annotations

import argparse
import datetime
from typing import Any

import numpy as np

from benchmarks.gpu_common import log, measure_copy_bandwidth, time_graph, write_report

NK, NV, DK, DV, KW = 16, 32, 128, 128, 4
EPS = 1e-6
PATHS = ("cluster", "cluster_head", "pair", "four")


def bench_batch(dev: Any, B: int, layers: int, rng: np.random.Generator, bw: float) -> tuple[float, dict]:
    """One batch size: (the floor in seconds, path -> seconds per layer)."""
    from hybrid_runtime.cuda.gdn import CudaGdn
    from hybrid_runtime.cuda.kernels import load_module
    from hybrid_runtime.cuda.state import DeviceStateCache
    from hybrid_runtime.state_cache import StateLayout

    C, vd = 2 * NK * DK + NV * DV, NV * DV
    P = C + vd + 2 * NV  # p = [u | z | b | a]
    fused = load_module("fused.cu", ("-DDT=2",), dev.arch)
    layout = StateLayout(B + 8, (KW - 1, C), (NV, DK, DV))
    conv_np, rec_np = layout.allocate()
    conv_np[:] = rng.standard_normal(conv_np.shape, np.float32)
    rec_np[:] = 0.1 * rng.standard_normal(rec_np.shape, np.float32)
    caches = [DeviceStateCache(dev, layout, layers=[0]) for _ in range(layers)]
    for c in caches:
        c.upload_layer(0, conv_np, rec_np)
    gdn = CudaGdn(dev, layout, NK, act_dtype="float32", out_dtype="bfloat16")
    w = dev.upload((0.5 * rng.standard_normal((C, KW))).astype(np.float32))
    nea = dev.upload((-np.exp(0.3 * rng.standard_normal(NV))).astype(np.float32))
    dtb = dev.upload(rng.standard_normal(NV).astype(np.float32))
    norm = dev.upload((1.0 + 0.2 * rng.standard_normal(DV)).astype(np.float32))
    p = dev.upload(rng.standard_normal((B, P)).astype(np.float32))
    sl = dev.upload(rng.permutation(B + 8)[:B].astype(np.int32))
    g, beta = dev.empty((B, NV), "float32"), dev.empty((B, NV), "float32")
    x, core, o = dev.empty((B, C), "float32"), dev.empty((B, vd), "float32"), dev.empty((B, vd), "bfloat16")

    def step(path: str, i: int) -> None:
        c = caches[i % layers]
        if path in ("cluster", "cluster_head"):
            gdn.cluster_decode(c.conv[0], c.recurrent[0], sl.ptr, p.ptr, P, w, B, p.ptr, P, C + vd, C + vd + NV,
                               nea.ptr, dtb.ptr, p.ptr + 4 * C, P, norm.ptr, EPS, o.ptr, core_ptr=core.ptr,
                               head=path == "cluster_head")
        elif path == "pair":
            gdn.conv_gates_decode(c.conv[0], sl.ptr, p.ptr, P, w, x.ptr, B, p.ptr, P, C + vd, C + vd + NV,
                                  nea.ptr, dtb.ptr, g.ptr, beta.ptr)
            gdn.delta_norm_decode(c.recurrent[0], sl.ptr, x.ptr, g.ptr, beta.ptr, p.ptr + 4 * C, P, norm.ptr,
                                  EPS, o.ptr, B, core_ptr=core.ptr)
        else:
            fused.kernel("gdn_gates").launch(
                dev, (-(-B * NV // 256), 1, 1), (256, 1, 1), 0,
                [("ptr", p.ptr), ("i64", P), ("i32", C + vd), ("i32", C + vd + NV), ("ptr", nea.ptr),
                 ("ptr", dtb.ptr), ("ptr", g.ptr), ("ptr", beta.ptr), ("i32", B), ("i32", NV)], pdl=True)
            gdn.conv_decode(c.conv[0], sl.ptr, p, w, x, B, u_stride=P)
            gdn.delta_decode(c.recurrent[0], sl.ptr, x, g, beta, core, B)
            fused.kernel("gated_rmsnorm").launch(
                dev, (B, -(-NV // 4), 1), (128, 1, 1), 0,
                [("ptr", core.ptr), ("ptr", p.ptr + 4 * C), ("i64", P), ("ptr", norm.ptr), ("ptr", o.ptr),
                 ("i32", B), ("i32", NV), ("i32", DV), ("f32", EPS)], pdl=True)

    state = layout.recurrent_row_bytes + layout.conv_row_bytes
    floor = B * (2 * state + 4 * (C + vd)) / bw
    ok = {"cluster": gdn.cluster_decode_ok, "cluster_head": gdn.cluster_head_decode_ok}
    t = {path: time_graph(dev, lambda i, path=path: step(path, i), layers) for path in PATHS if ok.get(path, True)}
    log(f"B={B}: floor {floor * 1e6:.1f} us, " + ", ".join(f"{k} {v * 1e6:.2f} us" for k, v in t.items()))
    return floor, t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--out", default="/tmp/gpu_gdn_decode.md")
    args = ap.parse_args(argv)
    if args.layers < 1 or min(args.batches) < 1:
        ap.error("--layers and --batches must be >= 1")
    import torch

    from hybrid_runtime.cuda.driver import CudaDevice

    torch.cuda.init()
    dev = CudaDevice(0)
    bw = measure_copy_bandwidth(torch, dev)
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    rng = np.random.default_rng(0)
    rows = []
    for B in args.batches:
        floor, t = bench_batch(dev, B, args.layers, rng, bw)
        rows.append((B, floor, t))
    lines = [f"# A GDN layer's decode step, three ways ({datetime.date.today()})", "",
             f"`python3 -m benchmarks.gpu_gdn_decode --batches {' '.join(map(str, args.batches))} --layers "
             f"{args.layers}` on {torch.cuda.get_device_name(0)}; copy bandwidth measured in this run "
             f"{bw / 1e12:.2f} TB/s. Per layer, {args.layers} layers chained in one captured graph (us).", "",
             "| batch | floor (us) | cluster (128-thread CTAs) | x floor | cluster_head (a CTA per value head) | "
             "x floor | pair: 2 launches | x floor | four launches | x floor | cluster / pair | cluster_head / pair |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for B, floor, t in rows:
        cells = [f"{t[k] * 1e6:.2f} | {t[k] / floor:.2f}" if k in t else "- | -" for k in PATHS]
        ratios = [f"{t[k] / t['pair']:.3f}" if k in t else "-" for k in ("cluster", "cluster_head")]
        lines.append(f"| {B} | {floor * 1e6:.2f} | " + " | ".join(cells + ratios) + " |")
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
