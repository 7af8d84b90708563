"""Run in a subprocess by test_device_fault_gpu.py (a sticky CUDA error poisons the whole process's context):
serve 4 requests on a cuda bundle with a fault injected at an engine step, print one JSON line of what
happened. ``python tests/gpu/device_fault_case.py BUNDLE KIND STEP``."""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def main() -> int:
    bundle, kind, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    os.environ["HYBRID_LLM_INJECT_FAULT"] = f"{kind}@{step}"
    from hybrid_runtime.sampling import SamplingParams
    from hybrid_runtime.serving import GenerationRequest, RuntimeOptions, ServingEngine

    fatal: list[BaseException] = []
    finals: dict[str, dict] = {}
    done = threading.Event()
    lock = threading.Lock()

    def sink(ev) -> None:
        if ev.final:
            with lock:
                finals[ev.request_id] = {"reason": ev.finish_reason, "error": ev.error, "tokens": len(ev.output_ids)}
                if len(finals) == n:
                    done.set()

    eng = ServingEngine(bundle, RuntimeOptions(), on_fatal=fatal.append)
    n = 4
    for i in range(n):
        eng.submit(GenerationRequest(f"r{i}", prompt_ids=tuple(range(5, 20 + i)),
                                     params=SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)), sink)
    t0 = time.perf_counter()
    eng.start()
    answered = done.wait(60)
    seconds = time.perf_counter() - t0
    after = None
    first = dict(finals)
    if kind == "launch" and answered:  # the context survived: the engine still serves
        done.clear()
        finals.clear()
        n = 1
        eng.submit(GenerationRequest("after", prompt_ids=(5, 6, 7), params=SamplingParams(max_tokens=3)), sink)
        after = done.wait(30) and finals["after"]["reason"]
    be = eng.runner.backend
    health = be.dev.health()
    cause = getattr(eng.fatal, "cause", None)
    print(json.dumps({"answered": answered, "seconds": round(seconds, 3), "finals": first,
                      "fatal": type(eng.fatal).__name__ if eng.fatal else None, "on_fatal_calls": len(fatal),
                      "cause": getattr(cause, "name", None), "health": getattr(health, "name", None),
                      "after": after, "plan": be.memory_plan.describe() if be.memory_plan else None,
                      "capture_mib": round(be.capture_bytes / 2**20, 1)}))
    sys.stdout.flush()
    if kind == "launch":
        eng.shutdown()
    os._exit(0)  # a poisoned context: skip the driver's teardown (it may report the sticky error again)


if __name__ == "__main__":
    sys.exit(main())
