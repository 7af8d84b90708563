"""Async scheduling on the GPU (``pytest -m gpu``): a bf16 ``cuda`` bundle of the default model in a ServingEngine,
``async_scheduling`` auto (on for a cuda bundle) against off, on one workload of every way a request ends (EOS,
stop tokens, a stop string, min_tokens, lengths), greedy and seeded sampled rows (the device sampler's
counter-based generator: a step prepared ahead must draw the same (seed, position) keys), logprobs, staggered
arrivals (steps ahead dropped for them) and a cancel while a step runs ahead. The same tokens, texts, logprobs and
finish reasons; every slot and page back after. The host half is tests/unit/test_async_scheduling.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hybrid_runtime.sampling import SamplingParams
from hybrid_runtime.serving import Event, GenerationRequest, RuntimeOptions, ServingEngine, generate
from tests.serving_cases import Collect

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_bundle(default_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from builder.bundle import BuildOptions, build_bundle

    out = tmp_path_factory.mktemp("async") / "bf16"
    build_bundle(default_checkpoint, out, BuildOptions(backend="cuda", dtype="bfloat16", max_batch_size=16,
                                                       max_input_len=384, max_seq_len=512, max_num_tokens=256),
                 progress=lambda _m: None)
    return out


def _workload(tok_stop: int, text_stop: str) -> list[GenerationRequest]:
    rng = np.random.default_rng(4)
    out = []
    for i in range(14):
        ids = tuple(int(t) for t in rng.integers(3, 2048, int(rng.integers(3, 80))))
        sampled = i % 3 != 0
        params = SamplingParams(max_tokens=int(rng.integers(3, 40)), ignore_eos=i % 4 != 0,
                                temperature=0.9 if sampled else 0.0, top_p=0.9 if i % 2 else 1.0,
                                seed=700 + i if i % 3 == 1 else None, logprobs=3 if i % 5 == 1 else None)
        out.append(GenerationRequest(f"w{i}", prompt_ids=ids, params=params))
    out += [GenerationRequest("stoptok", prompt="The weather today", params=SamplingParams(
                max_tokens=24, ignore_eos=True, stop_token_ids=(tok_stop,))),
            GenerationRequest("stoptok-min", prompt="The weather today", params=SamplingParams(
                max_tokens=24, ignore_eos=True, stop_token_ids=(tok_stop,), min_tokens=14)),
            GenerationRequest("stopstr", prompt="The weather today", params=SamplingParams(
                max_tokens=24, ignore_eos=True, stop=(text_stop,)))]
    return out


def _serve(bundle: Path, mode: str, reqs: list[GenerationRequest]) -> tuple[dict[str, Event], dict, list[Event]]:
    eng = ServingEngine(bundle, RuntimeOptions(device="cuda", async_scheduling=mode)).start()
    try:
        assert eng.async_scheduling == (mode != "off")
        sink = Collect(len(reqs))
        cancelled: list[Event] = []
        three = threading.Event()

        def long_sink(ev: Event) -> None:
            cancelled.append(ev)
            if len(cancelled) == 3:
                three.set()

        eng.submit(GenerationRequest("cancel-me", prompt="Once upon a time", params=SamplingParams(
            max_tokens=300, ignore_eos=True)), long_sink)
        for i, r in enumerate(reqs):
            eng.submit(r, sink)
            if i % 5 == 4:
                time.sleep(0.02)
        assert three.wait(60)
        eng.cancel("cancel-me")
        assert sink.done.wait(300)
        finals = dict(sink.finals)
        # alone, a decoding request always has its next step prepared ahead: its stop token drops one (whatever
        # the timing of the batch above)
        finals["solo-stoptok"] = generate(eng, [GenerationRequest("solo-stoptok", prompt="The weather today", params=(
            SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=reqs[-3].params.stop_token_ids)))])[0]
        deadline = time.monotonic() + 20
        while eng.stats()["slots_in_use"] or eng.stats()["kv_pages_in_use"] or eng.stats()["requests_running"]:
            assert time.monotonic() < deadline, eng.stats()
            time.sleep(0.02)
        return finals, eng.stats(), cancelled
    finally:
        eng.shutdown()


def test_async_scheduling_on_the_gpu_gives_the_tokens_of_one_step_at_a_time(cuda_bundle: Path) -> None:
    eng = ServingEngine(cuda_bundle, RuntimeOptions(device="cuda", async_scheduling="off")).start()
    try:
        base = generate(eng, [GenerationRequest("b", prompt="The weather today",
                                                params=SamplingParams(max_tokens=24, ignore_eos=True))])[0]
    finally:
        eng.shutdown()
    reqs = _workload(base.output_ids[7], base.text.strip()[4:7])
    off, off_stats, _ = _serve(cuda_bundle, "off", reqs)
    on, on_stats, cancelled = _serve(cuda_bundle, "auto", reqs)
    for r in (*reqs, GenerationRequest("solo-stoptok")):
        a, b = off[r.request_id], on[r.request_id]
        assert (b.finish_reason, b.output_ids, b.text) == (a.finish_reason, a.output_ids, a.text), r.request_id
        assert len(b.logprobs) == len(a.logprobs)
        for x, y in zip(a.logprobs, b.logprobs):  # the same device computation: the same floats
            assert x == y, r.request_id
    assert on["stoptok"].finish_reason == "stop" and on["stopstr"].finish_reason == "stop"
    assert on["solo-stoptok"].finish_reason == "stop"
    assert [e.final for e in cancelled].count(True) == 1 and cancelled[-1].finish_reason == "cancelled"
    steps = on_stats["async_steps"]
    print(f"[async] async_steps {steps}; graph replays on {on_stats['graph_replays']}; "
          f"eager {on_stats['decode_eager']}")
    assert steps.get("launched", 0) > 20 and steps.get("dropped", 0) >= 1, steps
    assert off_stats.get("async_steps", {}) == {}
    assert sum(on_stats["graph_replays"].values()) > 0
