"""Async scheduling against one step at a time, in the ServingEngine on the GPU (issue 15: step as served vs GPU).

``python3 -m benchmarks.gpu_async_sched [--layers 40] [--concurrency 1 16 64] [--new 64] [--rounds 2]`` (device
script): builds the Qwen3.5-35B-A3B-shaped ``cuda`` bundle of ``benchmarks.gpu_serve`` (dummy bf16 weights made on
the GPU), starts one ServingEngine and, per concurrency ``c``, submits ``c`` greedy requests (32 prompt tokens,
``--new`` new tokens, EOS ignored) at once, alternately with ``async_scheduling`` off and on (the same engine: the
attribute is switched while it is idle; ``--rounds`` rounds of off, on). It prints the median inter-token latency
(the time between two tokens of a request, as the engine hands them out: what a streaming client sees) for both,
their ratio, and, as the baseline measured in the same run, the device time of those decode steps themselves (CUDA
events recorded before each step's upload and after its download, both modes): what a token would cost if the
host added nothing. Also checks that both modes gave the same tokens.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import statistics
import time
from pathlib import Path
from typing import Any


class StepEvents:
    """CUDA events around every step the backend launches (before its upload, after its download): the device time
    of each step as served, read when the step is finished. Appends (rows, us) to ``self.times``."""

    def __init__(self, be: Any) -> None:
        self.be, self.times = be, []
        self.pool = [(be.dev.event(), be.dev.event()) for _ in range(8)]
        self.turn = 0
        launch, finish = be._launch_step, be._finish_step

        def timed_launch(ctx: Any, forward: Any) -> None:
            ev = self.pool[self.turn % len(self.pool)]
            self.turn += 1
            be.dev.record(ev[0])
            launch(ctx, forward)
            be.dev.record(ev[1])
            ctx.bench_events = ev

        def timed_finish(ctx: Any) -> Any:
            res = finish(ctx)
            ev = getattr(ctx, "bench_events", None)
            if ev is not None:
                self.times.append((ctx.n_real, 1000.0 * be.dev.elapsed_ms(*ev)))
            return res

        be._launch_step, be._finish_step = timed_launch, timed_finish


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--new", type=int, default=64, help="new tokens per request")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of (off, on) per concurrency")
    ap.add_argument("--root", type=Path, default=Path("/tmp/gpu_async_sched"))
    a = ap.parse_args()

    from benchmarks.gpu_serve import _ids, build
    from hybrid_runtime.sampling import SamplingParams
    from hybrid_runtime.serving import GenerationRequest, RuntimeOptions, ServingEngine, generate

    bundle = build(a.root, a.layers, max(a.concurrency), 2048)
    eng = ServingEngine(bundle, RuntimeOptions()).start()
    be = eng.runner.backend
    events = StepEvents(be)
    auto = "on" if eng.async_scheduling else "off"
    print(f"{be.dev.limits.name}; {a.layers} layers; async_scheduling auto -> {auto}", flush=True)
    stamps: dict[str, list[float]] = collections.defaultdict(list)
    on_token = eng._on_token

    def timed(live: Any, tok: int, now: float, lp: Any = None) -> None:
        stamps[live.seq.request_id].append(now)
        on_token(live, tok, now, lp)

    eng._on_token = timed  # type: ignore[method-assign]
    try:
        generate(eng, [GenerationRequest("warm", prompt_ids=tuple(_ids(0, 0, 4)),
                                         params=SamplingParams(max_tokens=2))])
        print("| concurrency | ITL, async off (us) | ITL, async on (us) | on / off | device time of a step (us) | "
              "off - device | on - device | steps launched ahead / dropped | same tokens |")
        print("|---|---|---|---|---|---|---|---|---|")
        for c in a.concurrency:
            itl: dict[bool, list[float]] = {False: [], True: []}
            gpu_us: list[float] = []
            outs: dict[bool, list[tuple[int, ...]]] = {}
            async0 = dict(eng.stats()["async_steps"])
            for r in range(a.rounds):
                for mode in (False, True):
                    eng.async_scheduling = mode  # idle between generate() calls: read by the next step
                    stamps.clear()
                    events.times.clear()
                    tag = f"c{c}-r{r}-{int(mode)}"
                    fin = generate(eng, [GenerationRequest(f"{tag}-{w}", prompt_ids=tuple(_ids(w, 0, 32)),
                                                           params=SamplingParams(max_tokens=a.new, ignore_eos=True,
                                                                                 temperature=0))
                                         for w in range(c)])
                    outs.setdefault(mode, [ev.output_ids for ev in fin])
                    gpu_us += [us for rows, us in events.times if rows == c]
                    for ts in stamps.values():
                        itl[mode] += [y - x for x, y in itertools.pairwise(ts[1:])]  # decode steps after the 2nd token
            async1 = eng.stats()["async_steps"]
            gpu = statistics.median(gpu_us)
            off, on = (1e6 * statistics.median(itl[m]) for m in (False, True))
            launched = async1.get("launched", 0) - async0.get("launched", 0)
            dropped = async1.get("dropped", 0) - async0.get("dropped", 0)
            print(f"| {c} | {off:.0f} | {on:.0f} | {on / off:.3f} | {gpu:.0f} | {off - gpu:.0f} | {on - gpu:.0f} | "
                  f"{launched} / {dropped} | {outs[False] == outs[True]} |", flush=True)
            time.sleep(0.1)
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
