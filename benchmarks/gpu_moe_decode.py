"""The decode MoE's routed experts on the Qwen3.5-35B-A3B expert shape (H 2048, 256 experts of I 512, top-8, the
shared expert of I 512 folded in as expert 256 for n <= 16): the decode tensor-core kernels (``cuda/moe_decode.py``,
weights as the mma M operand) in every build of ``KNOB_SETS`` against fused.cu's CUDA-core pair (``moe_gate_up``
+ ``moe_down``, today's decode path) and the prefill's grouped GEMMs (``MoEPrefill.experts``, impl ``mma`` and
``wgmma_ws``), on the same routings.

    python3 -m benchmarks.gpu_moe_decode --out benchmarks/results/gpu_moe_decode_h200.md

Per token count n (1, 2, 4, 8, 16, 32, 64): :data:`ROUTINGS` routings of random float32 router logits, computed
once (moe_topk + moe_group: moe_route's bits and buffers, plus the prefill's tile list), and :data:`STACKS` copies
of the random bf16 weights (1.55 GB each); call i uses routing i % ROUTINGS on stack i % STACKS, so no call finds
the weights it reads in the 50 MB L2 (the shared expert included). Times: CUDA events around back-to-back calls
queued behind a spin kernel (no host gaps; PDL launches, as in the backend), median of 3 means of ``--calls``
calls. Rate: the distinct experts' bytes (3 * I * H * 2 per expert, averaged over the routings) / time, against
the device-to-device copy bandwidth measured in the same run (bytes read + written / time). Routing is not timed.
"""

# ruff: noqa: B023 - every closure below is timed (called) inside the loop iteration that defines it
from __future__ import annotations

import argparse
import datetime
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from benchmarks.gpu_common import log, measure_copy_bandwidth, time_on_stream, write_report

H, INTER, E, K = 2048, 512, 256, 8
TOKENS = (1, 2, 4, 8, 16, 32, 64)
FOLD_MAX_TOKENS = 16
ROUTINGS = 16
STACKS = 4
EXPERT_BYTES = 3 * INTER * H * 2


def timed(dev: Any, fn: Callable[[int], None], calls: int, reps: int = 3) -> float:
    """Median of ``reps`` means (seconds per call) of ``calls`` back-to-back ``fn(i)`` queued behind a spin kernel."""
    return time_on_stream(dev, fn, calls, runs=reps, warmup=range(ROUTINGS), offset_by_run=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/results/gpu_moe_decode_h200.md")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--knobs", default="", help="comma-separated KNOB_SETS names (default: all)")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME:KEY=VAL,...",
                    help="a build beside KNOB_SETS, e.g. dn32:dn_rows=32 (DecodeKnobs fields; repeatable)")
    ap.add_argument("--impl", default="mma,wgmma_ws", help="comma-separated MoEPrefill impls to compare")
    ap.add_argument("--calls", type=int, default=48, help="calls per timed run (a multiple of ROUTINGS is fair)")
    args = ap.parse_args()
    import numpy as np
    import torch

    from hybrid_runtime.cuda.backend import MOE_ROWS_PER_CTA, SMEM_DEFAULT, fill_random
    from hybrid_runtime.cuda.driver import CudaDevice
    from hybrid_runtime.cuda.kernels import load_module
    from hybrid_runtime.cuda.moe_decode import (
        KNOB_SETS,
        DecodeKnobs,
        MoEDecode,
        bytes_in_flight,
        groups_per_pass,
        smem_bytes,
    )
    from hybrid_runtime.cuda.moe_prefill import ROUTE_MAX_CTAS, MoEBuffers, MoEPrefill, tile_list_words

    torch.cuda.init()
    dev = CudaDevice(0)
    log(f"device {dev.limits.name}, {dev.limits.sm_count} SMs")
    copy_bw = measure_copy_bandwidth(torch, dev)
    log(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    fused = load_module("fused.cu", ("-DDT=2",), dev.arch)
    knob_sets = dict(KNOB_SETS)
    for spec in args.extra:
        name, _, fields = spec.partition(":")
        knob_sets[name] = DecodeKnobs(**{k: int(v) for k, v in (f.split("=") for f in fields.split(",") if f)})
    names = [x for x in args.knobs.split(",") if x] or list(knob_sets)
    decs = {name: MoEDecode(dev, "bfloat16", **asdict(knob_sets[name])) for name in names}
    impls = [x for x in args.impl.split(",") if x]
    if tuple(dev.compute_capability) != (9, 0):
        impls = [x for x in impls if x == "mma"]
    pres = {impl: MoEPrefill(dev, "bfloat16", impl=impl) for impl in impls}
    router = pres.get("mma") or MoEPrefill(dev, "bfloat16", impl="mma")

    stacks = []
    for s in range(STACKS):  # E + 1 experts: the shared one is expert E when folded
        gu = dev.empty((E + 1, 2 * INTER, H), "bfloat16")
        dn = dev.empty((E + 1, H, INTER), "bfloat16")
        fill_random(dev, fused, gu, 100 + s, 1.0 / 45)
        fill_random(dev, fused, dn, 200 + s, 1.0 / 22)
        stacks.append((gu, dn))
    ld = 264
    n_max = max(int(t) for t in args.tokens.split(","))
    P_max = n_max * (K + 1)
    act = dev.empty((P_max, INTER), "bfloat16")
    y = dev.empty((n_max, K + 1, H), "float32")
    h = dev.empty((n_max, H), "bfloat16")
    fill_random(dev, fused, h, 5, 1.0)
    lg = dev.empty((n_max, ld), "float32")
    routes = []  # per routing: its buffers (the tile list and counts for MoEPrefill) as MoEBuffers, kept alive
    for _ in range(ROUTINGS):
        b = {name: dev.empty(shape, dt) for name, shape, dt in (
            ("pw", (P_max,), "float32"), ("pe", (P_max,), "int32"), ("pl", (P_max,), "int32"),
            ("off", (E + 2,), "int32"), ("active", (E + 2,), "int32"),
            ("tiles", (tile_list_words(P_max, E + 1),), "int32"), ("cta", (ROUTE_MAX_CTAS, E + 1), "int32"))}
        routes.append((b, MoEBuffers(b["pw"].ptr, b["pe"].ptr, b["pl"].ptr, b["off"].ptr, b["active"].ptr,
                                     b["tiles"].ptr, b["cta"].ptr, act.ptr, y.ptr, (b["tiles"].size - 4) // 4)))

    rows = []
    for n in [int(t) for t in args.tokens.split(",")]:
        fold = n <= FOLD_MAX_TOKENS
        kk, e_all, ny = K + int(fold), E + int(fold), K + 1
        distinct = []
        for r, (b, bufs) in enumerate(routes):
            fused.kernel("fill_random_f32").launch(dev, (256, 1, 1), (256, 1, 1), 0,
                                                   [("ptr", lg.ptr), ("i64", n * ld), ("u64", 1000 * n + r),
                                                    ("f32", 2.0), ("f32", 0.0)])
            router.route(n, lg.ptr, ld, E, K, True, bufs, fold_shared=fold)
            distinct.append(int(dev.download(b["active"])[e_all]))
        mb = float(np.mean(distinct)) * EXPERT_BYTES
        tg = max(1, min(8, SMEM_DEFAULT // (H * 2)))
        tg_d = max(1, min(8, SMEM_DEFAULT // (INTER * 2)))
        grid_e = min(e_all, n * kk)

        def cuda_cores(i: int) -> None:
            b, _ = routes[i % ROUTINGS]
            gu, dn = stacks[i % STACKS]
            fused.kernel("moe_gate_up").launch(
                dev, (-(-INTER // MOE_ROWS_PER_CTA), grid_e, 1), (256, 1, 1), tg * H * 2,
                [("ptr", h.ptr), ("ptr", gu.ptr), ("i32", H), ("i32", INTER), ("i32", kk), ("i32", e_all),
                 ("ptr", b["off"].ptr), ("ptr", b["pl"].ptr), ("ptr", b["active"].ptr), ("ptr", act.ptr),
                 ("i32", tg)], pdl=True)
            fused.kernel("moe_down").launch(
                dev, (-(-H // MOE_ROWS_PER_CTA), grid_e, 1), (256, 1, 1), tg_d * INTER * 2,
                [("ptr", act.ptr), ("ptr", dn.ptr), ("ptr", b["pw"].ptr), ("i32", H), ("i32", INTER),
                 ("i32", kk), ("i32", ny), ("i32", e_all), ("ptr", b["off"].ptr), ("ptr", b["pl"].ptr),
                 ("ptr", b["active"].ptr), ("ptr", y.ptr), ("i32", tg_d)], pdl=True)

        cases: list[tuple[str, str, Callable[[int], None]]] = [("cuda cores (fused.cu)", "", cuda_cores)]
        for name, dec in decs.items():
            gcap = groups_per_pass(n, dec.knobs.gmax)
            note = (f"{dec.label}; gcap {gcap}, smem {smem_bytes('gate_up', gcap, dec.knobs) // 1024}/"
                    f"{smem_bytes('down', gcap, dec.knobs) // 1024} KB, in flight/CTA "
                    f"{bytes_in_flight('gate_up', gcap, dec.knobs) // 1024}/"
                    f"{bytes_in_flight('down', gcap, dec.knobs) // 1024} KB")
            parts = ("both", "gate_up", "down") if name in ("default", "early") else ("both",)
            for part in parts:

                def mma_decode(i: int, dec: MoEDecode = dec, part: str = part) -> None:
                    _, bufs = routes[i % ROUTINGS]
                    gu, dn = stacks[i % STACKS]
                    dec.launch(n, h.ptr, H, gu.ptr, dn.ptr, H, INTER, kk, ny, e_all, bufs, parts=part)

                label = f"mma_decode {name}" + ("" if part == "both" else f" ({part} only)")
                cases.append((label, note if part == "both" else "", mma_decode))
        for impl, pre in pres.items():

            def prefill(i: int, pre: MoEPrefill = pre) -> None:
                _, bufs = routes[i % ROUTINGS]
                gu, dn = stacks[i % STACKS]
                pre.experts(n, h.ptr, H, gu.ptr, dn.ptr, H, INTER, kk, ny, e_all, bufs)

            cases.append((f"MoEPrefill {impl} ({pre.gemm_impl(H, INTER)})", "", prefill))
        for label, note, fn in cases:
            t = timed(dev, fn, args.calls)
            # the part-only rows read a third (gate_up: 2/3, down: 1/3) of each expert's bytes
            share = 2 / 3 if "gate_up only" in label else 1 / 3 if "down only" in label else 1.0
            rate = mb * share / t
            row = {"n": n, "pairs": n * kk, "fold": fold, "experts": float(np.mean(distinct)), "mb": mb * share / 1e6,
                   "kernels": label, "us": t * 1e6, "tbs": rate / 1e12, "copy": rate / copy_bw, "note": note}
            log(row)
            rows.append(row)

    lines = [f"# Decode MoE: tensor cores with the weights as M vs CUDA cores vs the prefill GEMMs "
             f"({dev.limits.name}, {datetime.date.today().isoformat()})", "",
             f"Qwen3.5-35B-A3B routed experts: H {H}, {E} experts of I {INTER}, top-{K}; the shared expert (I {INTER}) "
             f"folded in as expert {E} for n <= {FOLD_MAX_TOKENS}; random bf16 weights ({STACKS} copies), "
             f"{ROUTINGS} random routings per n, call i on routing i % {ROUTINGS} and copy i % {STACKS} (no L2 reuse); "
             f"`python3 -m benchmarks.gpu_moe_decode`. Copy bandwidth in this run: **{copy_bw / 1e12:.2f} TB/s**. "
             f"Rate = distinct experts x {EXPERT_BYTES / 1e6:.2f} MB / time (routing not timed).", "",
             "| tokens | pairs | fold | distinct experts | MB read | kernels | us | TB/s | share of copy | build |",
             "|---:|---:|:---:|---:|---:|:---|---:|---:|---:|:---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['pairs']} | {'yes' if r['fold'] else 'no'} | {r['experts']:.1f} | "
                     f"{r['mb']:.1f} | {r['kernels']} | {r['us']:.1f} | {r['tbs']:.2f} | {r['copy']:.0%} | "
                     f"{r['note']} |")
    best = {}
    for r in rows:
        if "only" not in r["kernels"] and (r["n"] not in best or r["us"] < best[r["n"]]["us"]):
            best[r["n"]] = r
    lines += ["", "Fastest per token count: " + ", ".join(f"n={n}: {r['kernels']} {r['us']:.1f} us"
                                                           for n, r in best.items())]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
