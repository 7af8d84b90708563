"""Where the host time of a served decode step goes (issue 15: the step as served vs its graph replay).

``python3 -m benchmarks.gpu_host_profile [--layers 4] [--batches 1 8 64] [--context 1024] [--reps 300]``
builds the Qwen3.5-35B-A3B shape cut to ``--layers`` layers on random device weights (as
``benchmarks.gpu_decode_step``), captures its decode graphs, then per batch size times, over ``--reps`` steps:

* ``ModelRunner.step`` (what the serving engine calls: ``prepare`` + ``execute``), wall clock;
* ``prepare`` alone (validation, packing of the upload, plan choice: host only);
* the graph replay alone on the GPU (CUDA events), so that step - replay is the host's share;

and prints cProfile's top functions (own time) of the ``runner.step`` loop. Host work does not depend on the
number of layers when the step is one graph replay, so the 4-layer slice is enough.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import numpy as np

from benchmarks.gpu_common import log, time_on_stream
from benchmarks.gpu_decode_step import build, qwen35_moe_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()

    import torch

    from hybrid_runtime.engine import Phase
    from hybrid_runtime.runner import SampleRow, SeqStep
    from hybrid_runtime.sampling import SamplingParams

    torch.cuda.init()
    cfg = qwen35_moe_config(args.layers)
    maxB = max(args.batches)
    per = -(-(args.context + 16) // 16)
    be, runner, load = build(cfg, maxB, args.context + 64, maxB * per, args.batches)
    log(f"loaded: {load}")
    for B in args.batches:
        rng = np.random.default_rng(B)
        perm = rng.permutation(be.num_pages)[:B * per]
        steps = [SeqStep(b, np.asarray(perm[b * per:(b + 1) * per], np.int64), args.context - 1,
                         [int(rng.integers(0, cfg.vocab_size))]) for b in range(B)]
        rows = [SampleRow(SamplingParams(), seed=b, counter=args.context) for b in range(B)]
        for _ in range(5):
            runner.step(Phase.DECODE, steps, rows)
        walls, preps = [], []
        for _ in range(args.reps):
            t = time.perf_counter()
            runner.step(Phase.DECODE, steps, rows)
            walls.append(time.perf_counter() - t)
        for _ in range(args.reps):
            t = time.perf_counter()
            ctx = be.prepare(Phase.DECODE, steps, rows, False)
            preps.append(time.perf_counter() - t)
        g = ctx.graph
        gpu = float("nan")
        if g is not None:
            be.dev.copy_htod(be.inp.ptr, be.host_in.array[:ctx.upload_bytes])
            gpu = time_on_stream(be.dev, lambda i, g=g: g.launch(), 50, runs=3, warmup=(), spin_cycles=0)
        lone = call = lone_gpu = float("nan")
        if g is not None:  # one replay on an idle GPU, as a served step has it: the launch call, launch to sync
            calls, lones, lone_gpus = [], [], []
            for _ in range(args.reps):
                be.dev.synchronize()
                e0, e1 = be.dev.event(), be.dev.event()
                t = time.perf_counter()
                be.dev.record(e0)
                g.launch()
                t1 = time.perf_counter()
                be.dev.record(e1)
                be.dev.synchronize()
                lones.append(time.perf_counter() - t)
                calls.append(t1 - t)
                lone_gpus.append(be.dev.elapsed_ms(e0, e1) / 1e3)
            lone, call, lone_gpu = (statistics.median(x) for x in (lones, calls, lone_gpus))
        wall, prep = statistics.median(walls), statistics.median(preps)
        log(f"B={B}: runner.step {wall * 1e6:.0f} us, prepare {prep * 1e6:.0f} us, graph replay (GPU, queue "
            f"filled) {gpu * 1e6:.0f} us, step - replay {(wall - gpu) * 1e6:.0f} us, graph {g is not None}; "
            f"lone replay: cuGraphLaunch call {call * 1e6:.0f} us, launch to sync {lone * 1e6:.0f} us, GPU events "
            f"{lone_gpu * 1e6:.0f} us, step - lone {(wall - lone) * 1e6:.0f} us")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.reps):
            runner.step(Phase.DECODE, steps, rows)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
        print(f"---- B={B}: cProfile of {args.reps} runner.step calls, by own time", flush=True)
        print(out.getvalue(), flush=True)


if __name__ == "__main__":
    main()
