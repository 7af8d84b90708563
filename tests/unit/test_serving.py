"""The serving loop on the default bundle: batch invariance, admission, cancellation, validation."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from builder.bundle import BuildOptions, build_bundle
from hybrid_runtime.sampling import RequestValidationError, SamplingParams
from hybrid_runtime.serving import Event, GenerationRequest, RuntimeOptions, ServingEngine, generate


def _requests(n: int, seed: int, prefix: str, sampled_every: int = 4) -> list[GenerationRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(3, 300))
        ids = tuple(int(t) for t in rng.integers(3, 2048, length))
        sampled = i % sampled_every == sampled_every - 1
        params = SamplingParams(max_tokens=int(rng.integers(4, 24)), ignore_eos=True,
                                temperature=0.9 if sampled else 0.0, seed=1000 + i if sampled else None)
        out.append(GenerationRequest(f"{prefix}{i}", prompt_ids=ids, params=params))
    return out


@pytest.fixture(scope="module")
def engine(default_bundle: Path):
    eng = ServingEngine(default_bundle, RuntimeOptions()).start()
    yield eng
    eng.shutdown()


def _wait_idle(eng: ServingEngine, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = eng.stats()
        if s["slots_in_use"] == 0 and s["kv_pages_in_use"] == 0 and s["requests_running"] == 0:
            return s
        time.sleep(0.02)
    raise AssertionError(f"engine did not return to idle: {eng.stats()}")


def test_batch_invariance_with_staggered_admission_and_reused_slots(engine: ServingEngine) -> None:
    reqs = _requests(16, seed=5, prefix="b")
    solo = {r.request_id: generate(engine, [r])[0].output_ids for r in reqs}  # each alone
    generate(engine, _requests(16, seed=99, prefix="warm"))  # dirty every slot first
    finals: dict[str, Event] = {}
    done = threading.Event()

    def sink(ev: Event) -> None:
        if ev.final:
            finals[ev.request_id] = ev
            if len(finals) == len(reqs):
                done.set()

    for i, r in enumerate(reqs):  # admitted at different steps
        engine.submit(r, sink)
        if i % 4 == 3:
            time.sleep(0.03)
    assert done.wait(120)
    for r in reqs:
        ev = finals[r.request_id]
        assert ev.finish_reason == "length", ev
        assert ev.output_ids == solo[r.request_id], f"{r.request_id} differs when batched"
        assert len(ev.output_ids) == r.params.max_tokens
    _wait_idle(engine)
    assert engine.stats()["profile_switches"] == 0


def test_more_requests_than_slots_all_complete_in_admission_order(default_checkpoint: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "b4"
    build_bundle(default_checkpoint, bundle, BuildOptions(max_batch_size=4, max_input_len=64, max_seq_len=128),
                 progress=lambda _m: None)
    eng = ServingEngine(bundle).start()
    try:
        first_token: list[str] = []
        finals: dict[str, Event] = {}
        lock = threading.Lock()

        def sink(ev: Event) -> None:
            with lock:
                if not ev.final and ev.request_id not in first_token:
                    first_token.append(ev.request_id)
                if ev.final:
                    finals[ev.request_id] = ev

        ids = [f"q{i:02d}" for i in range(12)]
        for i, rid in enumerate(ids):
            eng.submit(GenerationRequest(rid, prompt_ids=(5 + i, 6, 7), params=SamplingParams(
                max_tokens=6, ignore_eos=True)), sink)
        deadline = time.monotonic() + 60
        while len(finals) < len(ids) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(finals[r].finish_reason == "length" for r in ids), finals
        assert first_token == ids  # FIFO admission, nobody rejected or overtaken
        _wait_idle(eng)
    finally:
        eng.shutdown()


def test_cancel_mid_decode_frees_slot_and_pages(engine: ServingEngine) -> None:
    got = threading.Event()
    events: list[Event] = []

    def sink(ev: Event) -> None:
        events.append(ev)
        if len(events) == 3:
            got.set()

    engine.submit(GenerationRequest("long", prompt="The weather today", params=SamplingParams(
        max_tokens=200, ignore_eos=True)), sink)
    assert got.wait(30)
    assert engine.stats()["slots_in_use"] == 1
    engine.cancel("long")
    _wait_idle(engine)
    finals = [e for e in events if e.final]
    assert len(finals) == 1 and finals[0].finish_reason == "cancelled"
    assert 3 <= len(finals[0].output_ids) < 200


def test_sink_failure_counts_as_client_gone(engine: ServingEngine) -> None:
    calls = []
    final = threading.Event()

    def sink(ev: Event) -> None:
        calls.append(ev)
        if ev.final:
            final.set()
        raise ConnectionError("client went away")

    engine.submit(GenerationRequest("gone", prompt="hello", params=SamplingParams(max_tokens=50, ignore_eos=True)),
                  sink)
    assert final.wait(30)
    _wait_idle(engine)
    assert calls[-1].final and calls[-1].finish_reason == "cancelled"
    assert len(calls) == 2  # the failed token event, then the one final event


@pytest.mark.parametrize("req, match", [
    (GenerationRequest("e1", prompt=""), "empty"),
    (GenerationRequest("e2", prompt_ids=()), "empty"),
    (GenerationRequest("e3", prompt_ids=(1, 99999)), "out of range"),
    (GenerationRequest("e4", prompt="x", prompt_ids=(1,)), "exactly one"),
    (GenerationRequest("e5", prompt_ids=(1,) * 385), "max_input_len"),
    (GenerationRequest("e6", prompt_ids=(1,) * 300, params=SamplingParams(max_tokens=300)), "max_seq_len"),
])
def test_invalid_requests_are_rejected_without_taking_a_slot(engine: ServingEngine, req, match: str) -> None:
    before = engine.stats()
    with pytest.raises(RequestValidationError, match=match):
        engine.submit(req, lambda ev: None)
    after = _wait_idle(engine)
    assert after["slots_in_use"] == 0 and after["prompt_tokens"] == before["prompt_tokens"]
    assert sum(after["rejected"].values()) == sum(before["rejected"].values()) + 1


def test_stop_strings_eos_and_text(engine: ServingEngine) -> None:
    base = generate(engine, [GenerationRequest("s0", prompt="The weather today",
                                               params=SamplingParams(max_tokens=20, ignore_eos=True))])[0]
    assert base.text and len(base.output_ids) == 20
    stop = base.text.strip()[3:6]
    cut = generate(engine, [GenerationRequest("s1", prompt="The weather today", params=SamplingParams(
        max_tokens=20, ignore_eos=True, stop=(stop,)))])[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and base.text.startswith(cut.text)
    tok = base.output_ids[5]
    by_id = generate(engine, [GenerationRequest("s2", prompt="The weather today", params=SamplingParams(
        max_tokens=20, ignore_eos=True, stop_token_ids=(tok,)))])[0]
    assert by_id.finish_reason == "stop" and by_id.output_ids[-1] == tok
    assert len(by_id.output_ids) == base.output_ids.index(tok) + 1


def test_single_context_mode_gives_same_tokens_and_counts_switches(default_bundle: Path,
                                                                     engine: ServingEngine) -> None:
    reqs = _requests(6, seed=21, prefix="p")
    per_ctx = generate(engine, reqs)
    eng = ServingEngine(default_bundle, RuntimeOptions(profile_pinning="single_context")).start()
    try:
        single = generate(eng, reqs)
        assert eng.stats()["profile_switches"] > 0
    finally:
        eng.shutdown()
    assert [e.output_ids for e in single] == [e.output_ids for e in per_ctx]
    assert engine.stats()["profile_switches"] == 0


def test_multi_block_on_gives_same_tokens_as_off(default_bundle: Path) -> None:
    reqs = _requests(16, seed=8, prefix="m")
    outs = {}
    for mode in ("off", "on"):
        eng = ServingEngine(default_bundle, RuntimeOptions(multi_block_mode=mode)).start()
        try:
            outs[mode] = [e.output_ids for e in generate(eng, reqs)]
            plans = eng.stats()["attention_plans"]
        finally:
            eng.shutdown()
        assert ("multi_block" in plans) == (mode == "on"), plans
    assert outs["on"] == outs["off"]


def test_runtime_options_are_validated(default_bundle: Path) -> None:
    from hybrid_runtime.config import BundleError, ConfigError

    with pytest.raises(ConfigError, match="multi_block_mode"):
        RuntimeOptions(multi_block_mode="sometimes")
    with pytest.raises(ConfigError, match="profile_pinning"):
        RuntimeOptions(profile_pinning="shared")
    with pytest.raises(BundleError, match="exceeds the bundle"):
        ServingEngine(default_bundle, RuntimeOptions(max_batch_size=17))
    with pytest.raises(ConfigError, match="heap_trim_interval_s"):
        RuntimeOptions(heap_trim_interval_s=-1.0)


def test_engine_thread_trims_the_heap_on_its_interval_and_counts_it(default_bundle: Path) -> None:
    """With heap_trim_interval_s the engine thread calls malloc_trim between steps (and while idle), at most once
    per interval, and the metrics count the calls; 0 never trims."""
    from hybrid_runtime.host_memory import release_free_heap

    if not release_free_heap():
        pytest.skip("no glibc malloc_trim here")
    t0 = time.monotonic()
    eng = ServingEngine(default_bundle, RuntimeOptions(heap_trim_interval_s=0.2)).start()
    off = ServingEngine(default_bundle, RuntimeOptions(heap_trim_interval_s=0)).start()
    try:
        for e in (eng, off):
            generate(e, _requests(4, seed=5, prefix="trim"))
        time.sleep(1.0)
        on_stats, off_stats = eng.stats(), off.stats()
        elapsed = time.monotonic() - t0
    finally:
        eng.shutdown()
        off.shutdown()
    # at most one trim per 0.2 s of the engine's life (not one per step or per idle wake-up), and some
    assert 2 <= on_stats["heap_trims"] <= elapsed / 0.2 + 1, (on_stats["heap_trims"], elapsed)
    assert on_stats["heap_trim_seconds"] > 0
    assert off_stats["heap_trims"] == 0 and off_stats["heap_trim_seconds"] == 0


def test_shutdown_sends_final_cancelled_to_inflight(default_bundle: Path) -> None:
    eng = ServingEngine(default_bundle).start()
    finals: list[Event] = []
    for i in range(3):
        eng.submit(GenerationRequest(f"f{i}", prompt="Hello", params=SamplingParams(max_tokens=400, ignore_eos=True)),
                   lambda ev: finals.append(ev) if ev.final else None)
    time.sleep(0.2)
    eng.shutdown()
    assert sorted(e.request_id for e in finals) == ["f0", "f1", "f2"]
    assert {e.finish_reason for e in finals} == {"cancelled"}
    with pytest.raises(RequestValidationError, match="shutting down"):
        eng.submit(GenerationRequest("late", prompt="x"), lambda ev: None)


def test_request_larger_than_the_kv_pool_is_refused_not_queued_forever(default_bundle: Path) -> None:
    page_bytes = 2 * 16 * 2 * 64 * 4 * 2  # K+V, page_size 16, 2 kv heads, head_dim 64, float32, 2 attention layers
    eng = ServingEngine(default_bundle, RuntimeOptions(kv_cache_bytes=4 * page_bytes)).start()
    try:
        with pytest.raises(RequestValidationError, match="KV pages"):
            eng.submit(GenerationRequest("big", prompt_ids=(1,) * 60, params=SamplingParams(max_tokens=20)),
                       lambda ev: None)
        ok = generate(eng, [GenerationRequest("small", prompt_ids=(1,) * 30, params=SamplingParams(
            max_tokens=20, ignore_eos=True))])[0]
        assert ok.finish_reason == "length"
    finally:
        eng.shutdown()


def test_offline_cli_runs_a_jsonl_workload_in_input_order(default_bundle: Path, tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    reqs = tmp_path / "r.jsonl"
    reqs.write_text('{"prompt": "Hello there", "max_tokens": 5, "ignore_eos": true}\n'
                    '{"prompt_ids": [5, 6, 7], "max_tokens": 3, "temperature": 0.8, "seed": 3}\n'
                    '{"prompt": "", "max_tokens": 3}\n')
    r = subprocess.run([sys.executable, "-m", "hybrid_runtime", "generate", "--engine", str(default_bundle),
                        "--requests", str(reqs)], capture_output=True, text=True, timeout=120)
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["id"] for row in rows] == ["line-1", "line-2", "line-3"]
    assert len(rows[0]["output_ids"]) == 5 and rows[0]["finish_reason"] == "length" and rows[0]["text"]
    assert rows[2]["finish_reason"] == "error" and "empty" in rows[2]["error"]
    assert r.returncode == 1  # one request failed
    solo = subprocess.run([sys.executable, "-m", "hybrid_runtime", "generate", "--engine", str(default_bundle),
                           "--prompt", "Hello there", "--max-tokens", "5", "--ignore-eos", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert json.loads(solo.stdout)["output_ids"] == rows[0]["output_ids"]


def test_warmup_plan_covers_the_largest_prefill_and_a_full_batch_within_the_pool(default_bundle: Path) -> None:
    eng = ServingEngine(default_bundle, RuntimeOptions(warmup=False))
    lim, b = eng.manifest.limits, eng.max_batch_size
    (longest,), batch = eng.warmup_plan()
    assert longest == min(lim.max_num_tokens, lim.max_input_len, lim.max_seq_len - 2)
    assert len(batch) == b and sum(batch) <= lim.max_num_tokens and min(batch) >= 1
    page_bytes = 2 * 16 * 2 * 64 * 4 * 2  # as in the KV-pool test below: 16-token pages
    small = ServingEngine(default_bundle, RuntimeOptions(kv_cache_bytes=4 * page_bytes, warmup=False))
    assert small.warmup_plan() == [[4 * 16 - 2]]  # one long prompt that fits 4 pages; no batch of 16 fits
    # the longest contexts: the last chunk of a max_input_len prompt, then max_seq_len decode rows
    (pre, (p_step,)), (pre2, (tail, head)), (pre3, wide), (dec, d_steps) = eng.warmup_long_steps()
    assert pre.name == "PREFILL" and len(p_step.token_ids) == lim.max_num_tokens
    assert p_step.start_pos + len(p_step.token_ids) == lim.max_input_len
    assert len(p_step.page_table) * 16 >= lim.max_input_len
    assert pre2.name == "PREFILL" and tail.start_pos + len(tail.token_ids) == lim.max_input_len
    assert head.start_pos == 0 and len(tail.token_ids) + len(head.token_ids) == lim.max_num_tokens
    assert not set(tail.page_table) & set(head.page_table) and len(head.page_table) * 16 >= len(head.token_ids)
    # the widest padding: a full batch, one long chunk at the end of the prompt, one token each for the others
    assert pre3.name == "PREFILL" and len(wide) == b and len({s.slot for s in wide}) == b
    assert sum(len(s.token_ids) for s in wide) == lim.max_num_tokens
    assert wide[0].start_pos + len(wide[0].token_ids) == lim.max_input_len
    assert all(s.start_pos == 0 and len(s.token_ids) == 1 for s in wide[1:])
    wide_pages = [p for s in wide for p in s.page_table]
    assert len(set(wide_pages)) == len(wide_pages) and max(wide_pages) < lim.num_kv_pages
    per = -(-lim.max_seq_len // 16)
    assert dec.name == "DECODE" and len(d_steps) == min(b, lim.num_kv_pages // per)
    assert all(s.start_pos == lim.max_seq_len - 1 and len(s.page_table) == per for s in d_steps)
    assert len({s.slot for s in d_steps}) == len(d_steps)
    pages = [p for s in d_steps for p in s.page_table]
    assert len(set(pages)) == len(pages) and max(pages) < lim.num_kv_pages
    ((dec_small, (only,)),) = small.warmup_long_steps()  # 4 pages: one row at the 64-token context they hold
    assert dec_small.name == "DECODE" and only.start_pos == 63 and list(only.page_table) == [0, 1, 2, 3]


def test_warmup_leaves_no_trace_in_metrics_slots_or_tokens(default_bundle: Path) -> None:
    """start() with the warm-up: the counters start at zero, every slot and page is free, and what is served
    after it (greedy and seeded sampling, in a batch) is token for token what an engine without it serves."""
    reqs = _requests(6, seed=11, prefix="w", sampled_every=2)
    cold = ServingEngine(default_bundle, RuntimeOptions(warmup=False)).start()
    try:
        want = [e.output_ids for e in generate(cold, reqs)]
    finally:
        cold.shutdown()
    warm = ServingEngine(default_bundle, RuntimeOptions(warmup=True)).start()
    try:
        s = warm.stats()
        assert s["prompt_tokens"] == 0 and s["tokens_generated"] == 0 and not any(s["steps"].values()), s
        assert s["slots_in_use"] == 0 and s["kv_pages_in_use"] == 0 and s["requests_running"] == 0
        got = [e.output_ids for e in generate(warm, reqs)]
        assert warm.stats()["prompt_tokens"] == sum(len(r.prompt_ids or ()) for r in reqs)
    finally:
        warm.shutdown()
    assert got == want


def test_a_failing_warmup_stops_start_with_the_reason(default_bundle: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from hybrid_runtime.backend import DeviceLost

    eng = ServingEngine(default_bundle, RuntimeOptions(warmup=True))

    def lost(*a: object, **k: object) -> None:
        raise DeviceLost("test: device gone during warm-up")

    monkeypatch.setattr(eng.runner, "step", lost)
    with pytest.raises(RuntimeError, match="warm-up failed: device failure: test: device gone"):
        eng.start()
    assert eng._thread is None and not eng._live
