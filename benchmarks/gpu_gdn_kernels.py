"""GDN prefill on the GPU kernel by kernel: the whole ``prefill_launch`` (conv + window + chunked delta rule) of the
"tf32" and "bf16" builds on one layer of the Qwen3.5-35B-A3B shape, each launch's mean GPU time from the PyTorch
profiler, and how far the two builds' outputs and final states are apart.

    python3 -m benchmarks.gpu_gdn_kernels --cases 1x8192,8x4096

Layer: 16 key heads, 32 value heads, dk = dv = 128, conv K = 4, float32 u / state / o (what the CUDA backend runs);
random u, decays in [-0.5, 0], betas in [0, 1], states ~ N(0, 0.02). Time = median of 3 runs of 20 back-to-back calls
(CUDA events); per-kernel = profiler device time over 10 calls.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

NK, NV, DK, DV, KW = 16, 32, 128, 128, 4
BUILDS = ("tf32", "bf16")


def run_case(torch: Any, dev: Any, S: int, T: int) -> list[str]:
    """Markdown rows for S sequences of T tokens, one per build, then the builds' difference."""
    from hybrid_runtime.cuda.driver import DeviceArray
    from hybrid_runtime.cuda.gdn import CudaGdn
    from hybrid_runtime.cuda.state import DeviceStateCache
    from hybrid_runtime.state_cache import StateLayout

    C, N = 2 * NK * DK + NV * DV, S * T
    layout = StateLayout(S, (KW - 1, C), (NV, DK, DV))
    cache = DeviceStateCache(dev, layout, layers=[0])
    rec, conv = cache.recurrent[0], cache.conv[0]
    rt, ct = torch.as_tensor(rec, device="cuda"), torch.as_tensor(conv, device="cuda")
    rt.normal_().mul_(0.02)
    ct.normal_()
    r0, c0 = rt.clone(), ct.clone()
    u = torch.randn(N, C, device="cuda")
    g = -torch.rand(N, NV, device="cuda") * 0.5
    beta = torch.rand(N, NV, device="cuda")
    ua, ga, ba = (DeviceArray.from_torch(t) for t in (u, g, beta))
    wa = DeviceArray.from_torch(torch.randn(C, KW, device="cuda") * 0.5)
    meta = dev.upload(np.concatenate([np.arange(S + 1) * T, np.arange(S)]).astype(np.int32))
    x = dev.empty((N, C), "float32")
    rows, res = [], {}
    for p in BUILDS:
        gdn = CudaGdn(dev, layout, NK, "float32", precision=p)
        assert gdn.precision == p
        ws = dev.empty((gdn.workspace_bytes(N, S),), "uint8")
        o = dev.empty((N, NV * DV), "float32")

        def call(gdn: Any = gdn, ws: Any = ws, o: Any = o) -> None:
            gdn.prefill_launch(conv, rec, meta.ptr, meta.ptr + 4 * (S + 1), S, T, ua.ptr, C, ga.ptr, ba.ptr, wa,
                               x.ptr, o.ptr, workspace=ws, n_tokens=N)

        rt.copy_(r0)
        ct.copy_(c0)
        call()
        torch.cuda.synchronize()
        res[p] = (torch.as_tensor(o, device="cuda").clone(), rt.clone())
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(3):
            a.record()
            for _ in range(20):
                call()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 20)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                call()
            torch.cuda.synchronize()
        ks = {e.key: e.device_time_total / e.count for e in prof.key_averages() if e.device_time_total > 0}
        rows.append(f"| {S} x {T} | {p} | {sorted(ts)[1]:.3f} | "
                    + ", ".join(f"`{k}` {v:.1f}" for k, v in ks.items()) + " |")
    do = float((res["bf16"][0] - res["tf32"][0]).norm() / res["tf32"][0].norm())
    dsn = float((res["bf16"][1] - res["tf32"][1]).norm() / res["tf32"][1].norm())
    rows.append(f"| {S} x {T} | bf16 vs tf32 | | o {do:.2e}, state {dsn:.2e} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="1x8192,8x4096", help="comma-separated SxT (sequences x tokens)")
    a = ap.parse_args()
    import torch

    from hybrid_runtime.cuda.driver import CudaDevice

    torch.cuda.init()
    dev = CudaDevice(0, stream=0)
    print("| case | build | full ms | kernels (us per call) |\n|---|---|---|---|")
    for case in a.cases.split(","):
        S, T = (int(v) for v in case.split("x"))
        for row in run_case(torch, dev, S, T):
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
