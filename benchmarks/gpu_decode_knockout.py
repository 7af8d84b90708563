"""Where a captured decode step's GPU time goes, by knockout: the 40-layer Qwen3.5-35B-A3B step (random bf16 weights,
as benchmarks.gpu_decode_step) captured as a CUDA graph in full and again with one class of kernels left out; the
difference in replay time is what that class costs inside the programmatic-dependent chain (its own duration minus
what overlaps its neighbours), which the eager per-kernel profile cannot show.

    python3 -m benchmarks.gpu_decode_knockout --out benchmarks/results/gpu_decode_knockout_h200.md

A knocked-out graph computes garbage (its inputs are whatever the buffers held), which does not matter for timing:
every remaining kernel reads and writes the same bytes as in the full step (the skipped router leaves the previous
step's routing in place, so the experts read the same number of weights).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from benchmarks.gpu_common import log, measure_copy_bandwidth, time_on_stream, write_report
from benchmarks.gpu_decode_step import build, qwen35_moe_config

# class -> (label, which launches it removes)
CLASSES = {
    "dense": "decode GEMMs (projections, lm_head: dense_decode / cuBLASLt)",
    "experts": "routed + shared experts (moe_dec_gate_up, moe_dec_down)",
    "router": "router GEMM + routing (moe_router_route)",
    "norms": "add + RMSNorm (rmsnorm_rows)",
    "gdn": "GDN decode pair (conv + gates, delta rule + gated norm)",
    "attention": "decode attention (+ its reduce)",
    "attn_small": "attn_qkv, sigmoid_mul",
    "sampler": "sampler",
}


@contextlib.contextmanager
def knocked_out(be: Any, cls: str | None) -> Iterator[None]:
    """Within the block, launches of class ``cls`` are skipped (None: nothing is)."""
    undo: list[Callable[[], None]] = []

    def patch(obj: Any, name: str, fn: Any) -> None:
        had = name in vars(obj)
        old = vars(obj).get(name)
        setattr(obj, name, fn)
        undo.append(lambda: setattr(obj, name, old) if had else delattr(obj, name))

    def skip(*a: Any, **k: Any) -> None:
        return None

    if cls == "dense":
        if be.dense is not None:
            patch(be.dense, "launch", skip)
        patch(be.blas, "gemm", skip)
    elif cls == "experts":
        for m in {id(m): m for m in (be.moe_mma_decode, be.moe_mma_decode_one, be.moe_mma_decode_many)
                  if m is not None}.values():  # every build a step size takes (1-row steps: dn_pre)
            patch(m, "launch", skip)
    elif cls == "router" and be.moe_router is not None:
        patch(be.moe_router, "launch", skip)
    elif cls == "gdn" and be.gdn_k is not None:
        patch(be.gdn_k, "conv_gates_decode", skip)
        patch(be.gdn_k, "delta_norm_decode", skip)
    elif cls == "attention":
        patch(be.attn, "launch", skip)
    elif cls == "sampler":
        patch(be.sampler, "launch", skip)
    elif cls in ("norms", "attn_small"):
        names = {"norms": {"rmsnorm_rows"}, "attn_small": {"attn_qkv", "sigmoid_mul"}}[cls]
        orig = be._launch

        def launch(name: str, *a: Any, **k: Any) -> None:
            if name not in names:
                orig(name, *a, **k)

        patch(be, "_launch", launch)
    try:
        yield
    finally:
        for u in reversed(undo):
            u()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/gpu_decode_knockout_h200.md")
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    import torch

    from hybrid_runtime.cuda.driver import CudaDevice, CudaGraph
    from hybrid_runtime.engine import Phase
    from hybrid_runtime.runner import SampleRow, SeqStep
    from hybrid_runtime.sampling import SamplingParams

    torch.cuda.init()
    bw = measure_copy_bandwidth(torch, CudaDevice(0, stream=0))
    cfg = qwen35_moe_config(args.layers)
    maxB, ctx_len = max(args.batches), args.context
    pages = maxB * (-(-(ctx_len + 16) // 16))
    be, runner, _ = build(cfg, maxB, ctx_len + 64, pages, args.batches)
    name = torch.cuda.get_device_name(0)
    lines = [f"# Decode step by knockout ({name}, {args.layers} layers, context {ctx_len})", "",
             f"`python3 -m benchmarks.gpu_decode_knockout`; copy bandwidth in this run {bw / 1e12:.2f} TB/s. Each row: "
             "graph replay (ms) of the step without that class, and the difference from the full step.", ""]
    for B in args.batches:
        rng = np.random.default_rng(B)
        per = -(-(ctx_len + 1) // be.lim.page_size)
        perm = rng.permutation(be.num_pages)[:B * per]
        steps = [SeqStep(b, np.asarray(perm[b * per:(b + 1) * per], np.int64), ctx_len - 1,
                         [int(rng.integers(0, cfg.vocab_size))]) for b in range(B)]
        rows = [SampleRow(SamplingParams())] * B
        for _ in range(3):
            runner.step(Phase.DECODE, steps, rows)
        ctx = be.prepare(Phase.DECODE, steps, rows, False)
        ctx.graph = None
        be.dev.copy_htod(be.inp.ptr, be.host_in.array[:ctx.upload_bytes])
        times = {}
        for cls in (None, *CLASSES):
            with knocked_out(be, cls):
                def body(ctx: Any = ctx) -> None:
                    be._sample(ctx, runner._forward(ctx))

                body()
                g = CudaGraph(be.dev, body)
            g.launch()
            be.dev.synchronize()
            # graph launches enqueue far faster than a step runs: no spin kernel needed ahead of them
            times[cls] = (time_on_stream(be.dev, lambda i, g=g: g.launch(), 30, runs=5, warmup=(), spin_cycles=0) * 1e3,
                          g.num_nodes)
            g.destroy()
            log(f"B={B} without {cls}: {times[cls][0]:.3f} ms, {times[cls][1]} kernels")
        full, nodes = times[None]
        lines += [f"## batch {B}: full step {full:.3f} ms, {nodes} kernels", "",
                  "| left out | kernels removed | replay (ms) | its cost in the chain (ms) | share |",
                  "|---|---|---|---|---|"]
        for cls, label in CLASSES.items():
            t, n = times[cls]
            lines.append(f"| {label} | {nodes - n} | {t:.3f} | {full - t:.3f} | {(full - t) / full:.0%} |")
        lines.append("")
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
