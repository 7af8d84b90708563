"""Gated DeltaNet prefill delta rule on the GPU: the chunked WY/UT path (gdn_chunk_prep + gdn_chunk_state) in
its builds (precision "fp32": float32 SIMT; "tf32": tensor cores, (I + A)^-1 prep, 64-column state CTAs;
"tf32_v2": the same with 32-column state CTAs; "tf32_v1": the first tensor-core build; the last two for
comparison; prep and state pass also timed apart; "bf16": the tf32 prep, then the state pass split in two on bf16
tensor cores, gdn_chunk_h + gdn_chunk_o, what the cuda backend runs for bf16 bundles) against the token scan
(gdn_prefill), one layer of the Qwen3.5-35B-A3B shape.

    python3 -m benchmarks.gpu_gdn_prefill --out benchmarks/results/gdn_prefill_h200.md

Layer: 16 key heads, 32 value heads, dk = dv = 128, conv K = 4 (C = 8192), float32 state and activations
(what the CUDA backend runs). Timed: the whole prefill_launch (conv + window + delta rule), and the delta
rule alone (the conv output x is computed once and reused), each call from the same slots (the state
round-trips through HBM either way). CUDA-event timing, median of 3 queue-filled runs.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from typing import Any

import numpy as np

from benchmarks.gpu_common import log, time_calls, write_report

NK, NV, DK, DV, KW = 16, 32, 128, 128, 4
CASES = [(1, 1024), (1, 8192), (1, 32768), (8, 4096)]  # (sequences, tokens each)
# the scan, the chunked fp32 build, the chunked tf32 build (inverse-form prep, 64-column state CTAs), the
# previous tf32 builds (32-column state CTAs; SIMT forward substitution)
MODES = ("scan", "chunked", "tf32", "tf32_v2", "tf32_v1", "bf16")
TC_MODES = ("tf32", "tf32_v2", "tf32_v1")


def bench_case(torch: Any, dev: Any, gdns: dict[str, Any], conv: Any, rec: Any, wa: Any, ws: Any, S: int,
               T: int) -> tuple:
    """Time the three paths on S sequences of T tokens; returns (S, T, {(kind, mode): seconds},
    {mode: (o diff, state diff) vs the scan})."""
    from hybrid_runtime.cuda.driver import DeviceArray

    C = 2 * NK * DK + NV * DV
    N = S * T
    u = torch.randn(N, C, device="cuda")
    g = -torch.rand(N, NV, device="cuda") * 0.5
    beta = torch.rand(N, NV, device="cuda")
    ua, ga, ba = (DeviceArray.from_torch(t) for t in (u, g, beta))
    meta = np.concatenate([np.arange(S + 1) * T, np.arange(S)]).astype(np.int32)
    md = dev.upload(meta)
    starts, slots = md.ptr, md.ptr + 4 * (S + 1)
    x = dev.empty((N, C), "float32")
    o = {m: dev.empty((N, NV * DV), "float32") for m in MODES}

    def full(mode: str):
        gdn, pm = gdns[mode], "scan" if mode == "scan" else "chunked"
        return lambda i: gdn.prefill_launch(conv, rec, starts, slots, S, T, ua.ptr, C, ga.ptr, ba.ptr, wa,
                                            x.ptr, o[mode].ptr, workspace=ws, n_tokens=N, mode=pm)

    def delta(mode: str):
        gdn = gdns[mode]
        if mode == "scan":
            smem = gdn.chunk * (2 * DK + 32 + 3) * 4
            k = gdn.module.kernel("gdn_prefill")
            return lambda i: k.launch(dev, (DV // 32, NV, S), (128, 1, 1), smem,
                                      [("ptr", x.ptr), ("ptr", ga.ptr), ("ptr", ba.ptr), ("ptr", starts),
                                       ("ptr", slots), ("ptr", rec.ptr), ("i64", gdn.rec_row),
                                       ("ptr", o[mode].ptr), ("i32", S), ("i32", NK), ("i32", NV),
                                       ("i32", gdn.chunk)])
        return lambda i: gdn.delta_prefill_chunked(rec, starts, slots, S, T, ga.ptr, ba.ptr, x.ptr, o[mode].ptr,
                                                   ws, N)

    def one_kernel(mode: str, name: str):
        """Only gdn_chunk_prep or only gdn_chunk_state of a chunked build (the workspace holds the last prep's
        output, so the state pass reads real data)."""
        gdn = gdns[mode]
        ws_w, ws_u, ws_a, ws_s = gdn.workspace_views(ws.ptr, N)
        k = gdn.chunk_module.kernel(name)
        if name == "gdn_chunk_prep":
            args = [("ptr", x.ptr), ("ptr", ga.ptr), ("ptr", ba.ptr), ("ptr", starts), ("ptr", ws_w), ("ptr", ws_u),
                    ("ptr", ws_a), ("ptr", ws_s), ("i32", S), ("i32", NK), ("i32", NV)]
            grid, smem = (-(-T // 64), NV, S), gdn.chunk_smem[0]
        else:
            args = [("ptr", x.ptr), ("ptr", starts), ("ptr", slots), ("ptr", rec.ptr), ("i64", gdn.rec_row),
                    ("ptr", ws_w), ("ptr", ws_u), ("ptr", ws_a), ("ptr", ws_s), ("ptr", o[mode].ptr), ("i32", S),
                    ("i32", NK), ("i32", NV)]
            grid, smem = (-(-DV // gdn.chunk_cols), NV, S), gdn.chunk_smem[1]
        return lambda i: k.launch(dev, grid, (256, 1, 1), smem, args, pdl=True)

    # sanity: both paths from the same state agree
    r0 = torch.as_tensor(rec, device="cuda").clone()
    c0 = torch.as_tensor(conv, device="cuda").clone()
    outs = {}
    for m in MODES:
        torch.as_tensor(rec, device="cuda").copy_(r0)
        torch.as_tensor(conv, device="cuda").copy_(c0)
        full(m)(0)
        torch.cuda.synchronize()
        outs[m] = (torch.as_tensor(o[m], device="cuda").clone(), torch.as_tensor(rec, device="cuda")[:S].clone())
    errs: dict[str, Any] = {m: (float((outs[m][0] - outs["scan"][0]).norm() / outs["scan"][0].norm()),
                                float((outs[m][1] - outs["scan"][1]).norm() / outs["scan"][1].norm()))
                            for m in MODES[1:]}
    errs["tf32_vs_v2"] = float((outs["tf32"][0] - outs["tf32_v2"][0]).norm() / outs["tf32_v2"][0].norm())
    errs["bf16_vs_tf32"] = float((outs["bf16"][0] - outs["tf32"][0]).norm() / outs["tf32"][0].norm())
    host_us = 60.0
    t = {(kind, m): time_calls(torch, (full if kind == "full" else delta)(m), host_us_per_call=host_us,
                               max_calls=50)
         for kind in ("full", "delta") for m in MODES}
    for m in TC_MODES:  # the two kernels apart (each build's state pass after its own prep)
        delta(m)(0)
        t["prep", m] = time_calls(torch, one_kernel(m, "gdn_chunk_prep"), host_us_per_call=host_us, max_calls=50)
        t["state", m] = time_calls(torch, one_kernel(m, "gdn_chunk_state"), host_us_per_call=host_us, max_calls=50)
    # bf16: its prep (the tf32 build's with bf16 stores) alone; the split state pass (gdn_chunk_h + gdn_chunk_o)
    # is the rest of its delta rule
    bf = gdns["bf16"]
    pk = bf.chunk_module.kernel("gdn_chunk_prep")
    views = bf.workspace_views(ws.ptr, N)
    pargs = [("ptr", x.ptr), ("ptr", ga.ptr), ("ptr", ba.ptr), ("ptr", starts), *[("ptr", v) for v in views[:4]],
             ("i32", S), ("i32", NK), ("i32", NV), ("ptr", views[4])]
    t["prep", "bf16"] = time_calls(torch, lambda i: pk.launch(dev, (-(-T // 64), NV, S), (256, 1, 1), bf.chunk_smem[0],
                                                              pargs, pdl=True), host_us_per_call=host_us, max_calls=50)
    tc = "; ".join(f"{m} {t['delta', m] * 1e3:.3f} ms (prep {t['prep', m] * 1e3:.3f} + state "
                   f"{t['state', m] * 1e3:.3f}, full {t['full', m] * 1e3:.3f})" for m in TC_MODES)
    diffs = "; ".join(f"{m} {errs[m][0]:.1e}, {errs[m][1]:.1e}" for m in MODES[1:])
    log(f"S={S} T={T}: delta scan {t['delta', 'scan'] * 1e3:.3f} ms, chunked {t['delta', 'chunked'] * 1e3:.3f} ms; "
        f"{tc} (o, state diff vs scan: {diffs}; tf32 vs tf32_v2 o {errs['tf32_vs_v2']:.1e})")
    return S, T, t, errs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/gdn_prefill_h200.md")
    args = ap.parse_args()

    import torch

    from hybrid_runtime.cuda.driver import CudaDevice, DeviceArray
    from hybrid_runtime.cuda.gdn import CudaGdn
    from hybrid_runtime.cuda.state import DeviceStateCache
    from hybrid_runtime.state_cache import StateLayout

    torch.cuda.init()
    dev = CudaDevice(0, stream=0)
    C = 2 * NK * DK + NV * DV
    max_s = max(s for s, _ in CASES)
    layout = StateLayout(max_s, (KW - 1, C), (NV, DK, DV))
    cache = DeviceStateCache(dev, layout, layers=[0])
    torch.as_tensor(cache.conv[0], device="cuda").normal_()
    torch.as_tensor(cache.recurrent[0], device="cuda").normal_().mul_(0.02)
    conv, rec = cache.conv[0], cache.recurrent[0]
    gdn = CudaGdn(dev, layout, NK, "float32")
    gdns = {"scan": gdn, "chunked": gdn}
    for m in (*TC_MODES, "bf16"):
        gdns[m] = CudaGdn(dev, layout, NK, "float32", precision=m)
        assert gdns[m].precision == m
    w = torch.randn(C, KW, device="cuda") * 0.5
    wa = DeviceArray.from_torch(w)
    n_max = max(s * t for s, t in CASES)
    ws = dev.empty((max(g.workspace_bytes(n_max, max_s) for g in gdns.values()),), "uint8")
    log(f"{dev.limits.name}: workspace {gdn.workspace_bytes(n_max) / 2**20:.0f} MiB for {n_max} tokens")
    rows = [bench_case(torch, dev, gdns, conv, rec, wa, ws, S, T) for S, T in CASES]

    lines = [
        "# Gated DeltaNet prefill (delta rule) on the H200: chunked WY/UT (fp32 SIMT, tf32 tensor cores) vs token scan",
        "",
        f"Command: `{' '.join(['python3 -m benchmarks.gpu_gdn_prefill', *sys.argv[1:]])}`  ",
        f"Device: {dev.limits.name}; {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC.  ",
        f"Layer: {NK} key heads, {NV} value heads, dk = dv = {DK}, conv K = {KW}, float32 activations and "
        "state (the CUDA backend's GDN). Delta = the delta rule alone on a computed conv output (scan: "
        "`gdn_prefill`; chunked: `gdn_chunk_prep` + `gdn_chunk_state`, fp32 = `precision=\"fp32\"` build, tf32 = "
        "`precision=\"tf32\"` ((I + A)^-1 prep, 64-column state CTAs), tf32_v2 = the same with 32-column state CTAs, "
        "tf32_v1 = the first tensor-core build); full = "
        "`prefill_launch` (conv + window + delta rule). Median of 3 queue-filled "
        "runs (CUDA events).",
        "",
        "| sequences x tokens | scan delta ms | chunked fp32 delta ms | chunked tf32 delta ms | tf32 vs fp32 | "
        "tf32 Mtok/s | scan full ms | fp32 full ms | tf32 full ms | fp32 vs scan (o, state) | "
        "tf32 vs scan (o, state) | tf32 prep / state ms | tf32_v2 delta ms | tf32_v2 prep / state ms | "
        "tf32_v2 full ms | tf32 vs tf32_v2 (o) | tf32_v1 delta ms | tf32_v1 prep / state ms | "
        "tf32_v1 full ms | tf32_v1 vs scan (o, state) | bf16 delta ms | tf32 delta / bf16 delta | "
        "bf16 prep / h + o ms | bf16 full ms | bf16 vs scan (o, state) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for S, T, t, errs in rows:
        sd, cd, td = t["delta", "scan"], t["delta", "chunked"], t["delta", "tf32"]
        sf, cf, tf = t["full", "scan"], t["full", "chunked"], t["full", "tf32"]
        (eo, es), (to, ts) = errs["chunked"], errs["tf32"]
        lines.append(f"| {S} x {T} | {sd * 1e3:.3f} | {cd * 1e3:.3f} | {td * 1e3:.3f} | {cd / td:.2f}x | "
                     f"{S * T / td / 1e6:.2f} | {sf * 1e3:.3f} | {cf * 1e3:.3f} | {tf * 1e3:.3f} | "
                     f"{eo:.1e}, {es:.1e} | {to:.1e}, {ts:.1e} | {t['prep', 'tf32'] * 1e3:.3f} / "
                     f"{t['state', 'tf32'] * 1e3:.3f} | {t['delta', 'tf32_v2'] * 1e3:.3f} | "
                     f"{t['prep', 'tf32_v2'] * 1e3:.3f} / {t['state', 'tf32_v2'] * 1e3:.3f} | "
                     f"{t['full', 'tf32_v2'] * 1e3:.3f} | {errs['tf32_vs_v2']:.1e} | "
                     f"{t['delta', 'tf32_v1'] * 1e3:.3f} | "
                     f"{t['prep', 'tf32_v1'] * 1e3:.3f} / {t['state', 'tf32_v1'] * 1e3:.3f} | "
                     f"{t['full', 'tf32_v1'] * 1e3:.3f} | {errs['tf32_v1'][0]:.1e}, {errs['tf32_v1'][1]:.1e} | "
                     f"{t['delta', 'bf16'] * 1e3:.3f} | {td / t['delta', 'bf16']:.2f}x | "
                     f"{t['prep', 'bf16'] * 1e3:.3f} / {(t['delta', 'bf16'] - t['prep', 'bf16']) * 1e3:.3f} | "
                     f"{t['full', 'bf16'] * 1e3:.3f} | {errs['bf16'][0]:.1e}, {errs['bf16'][1]:.1e} |")
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
