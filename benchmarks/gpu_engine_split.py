"""Where a served decode step's wall time goes inside the ServingEngine's loop (issue 15: step as served vs GPU).

``python3 -m benchmarks.gpu_engine_split [--layers 40] [--concurrency 1 16 64] [--new 64]`` (device script):
builds the Qwen3.5-35B-A3B-shaped ``cuda`` bundle of ``benchmarks.gpu_serve`` (dummy bf16 weights generated on
the GPU), starts a ServingEngine in this process with ``async_scheduling="off"`` (one step at a time, so that the
pieces add up; ``benchmarks.gpu_async_sched`` compares it with async scheduling) and, per concurrency ``c``,
submits ``c`` greedy requests of 32 prompt tokens and ``--new`` new tokens at once. It wraps the engine thread's
pieces and prints, over the decode steps of ``c`` rows: the whole step (``_launch`` + ``_complete``: what a
token's inter-token latency is made of), the backend's ``prepare`` (validation, packing of the upload, plan and
graph choice: host only), ``execute`` (``launch`` + ``finish``: upload, graph replay, synchronise, download,
unpack: GPU time plus a little host) and ``_on_token`` per token (detokenisation, stop strings, the event,
metrics) times ``c``. What ``prepare`` and ``_on_token`` take is the host work an engine that overlapped it with
the previous step's GPU work would hide.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--new", type=int, default=64, help="new tokens per request")
    ap.add_argument("--root", type=Path, default=Path("/tmp/gpu_engine_split"))
    a = ap.parse_args()

    from benchmarks.gpu_serve import _ids, build
    from hybrid_runtime.sampling import SamplingParams
    from hybrid_runtime.serving import GenerationRequest, RuntimeOptions, ServingEngine, generate

    bundle = build(a.root, a.layers, max(a.concurrency), 2048)
    eng = ServingEngine(bundle, RuntimeOptions(async_scheduling="off")).start()
    times: dict[Any, list[float]] = collections.defaultdict(list)

    def wrap(obj: Any, name: str, key: str) -> None:
        f = getattr(obj, name)

        def timed(*args: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                times[key].append(time.perf_counter() - t)

        setattr(obj, name, timed)

    be = eng.runner.backend
    wrap(be, "prepare", "prepare")
    wrap(be, "launch", "launch")
    wrap(be, "finish", "finish")
    wrap(eng, "_on_token", "on_token")
    complete = eng._complete

    def timed_complete(flight: Any, ahead: bool) -> Any:  # from the step's launch (flight.t0) to its tokens handled
        try:
            return complete(flight, ahead)
        finally:
            b = flight.batch
            times[("step", b.phase.name, len(b.steps))].append(time.perf_counter() - flight.t0)

    eng._complete = timed_complete  # type: ignore[method-assign]
    try:
        generate(eng, [GenerationRequest("warm", prompt_ids=tuple(_ids(0, 0, 4)),
                                         params=SamplingParams(max_tokens=2))])
        print("| concurrency | decode steps | step (us) | prepare (us) | execute (us) | _on_token x c (us) | "
              "rest (us) | host share of the step |")
        print("|---|---|---|---|---|---|---|---|")
        for c in a.concurrency:
            times.clear()
            generate(eng, [GenerationRequest(f"c{c}-{w}", prompt_ids=tuple(_ids(w, 0, 32)),
                                             params=SamplingParams(max_tokens=a.new, ignore_eos=True, temperature=0))
                           for w in range(c)])  # all submitted at once
            full = times.get(("step", "DECODE", c), [])
            if not full:
                print(f"| {c} | 0 | - | - | - | - | - | - |")
                continue
            med = lambda xs: 1e6 * statistics.median(xs)  # noqa: E731
            st, pr = med(full), med(times["prepare"])
            ex = med([a + b for a, b in zip(times["launch"], times["finish"])])
            tok = c * med(times["on_token"])
            rest = st - pr - ex - tok
            print(f"| {c} | {len(full)} | {st:.0f} | {pr:.0f} | {ex:.0f} | {tok:.0f} | {rest:.0f} | "
                  f"{(st - ex) / st:.1%} |", flush=True)
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
