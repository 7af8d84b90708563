"""Async scheduling (serving.py, issue 15: the host's share of a served decode step): the engine prepares the next
decode step while the device runs the current one, patches its token ids in once they are known, and hands out the
finished step's tokens while the device runs the next.

On this machine the engine runs the default bundle on the host backend with ``async_scheduling="on"``: the steps do
not overlap there (the host backend computes a step inside its launch), but every piece of the lookahead's
bookkeeping runs - the scheduler's step ahead, dropped steps on EOS / stop tokens and arrivals, rows computed for a
request that finished on a stop string or was cancelled meanwhile, faults on a step launched ahead - and must give
exactly the tokens, texts, logprobs and finish reasons of ``"off"``. The cuda backend's half (its step prepared into
the second pinned buffer, ids patched, counts taken back) runs here on ``CudaBackend.prepare``'s stub backend
(``benchmarks.host_prepare_cpu``); the same engine on the GPU is ``tests/gpu/test_async_scheduling_gpu.py``."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hybrid_runtime.config import ConfigError, Limits
from hybrid_runtime.engine import Phase
from hybrid_runtime.sampling import SamplingParams
from hybrid_runtime.scheduler import Scheduler, Sequence
from hybrid_runtime.serving import FAULT_ENV, Event, GenerationRequest, RuntimeOptions, ServingEngine, generate
from tests.serving_cases import Collect

# ---- the scheduler's step ahead -----------------------------------------------------------------------

def _scheduler(max_batch: int = 4, pages: int = 64) -> Scheduler:
    lim = Limits(max_batch_size=max_batch, max_input_len=100, max_seq_len=128, max_num_tokens=256, page_size=16,
                 num_kv_pages=pages, num_state_slots=max_batch)
    return Scheduler(lim, max_batch, pages, lambda _slot: None)


def _decoding(s: Scheduler, lengths: list[int], max_tokens: int = 40) -> list[Sequence]:
    seqs = [Sequence(f"r{i}", list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens), max_len=n + max_tokens)
            for i, n in enumerate(lengths)]
    for q in seqs:
        s.add(q)
    b = s.schedule()
    assert b is not None and b.phase == Phase.PREFILL
    s.advance(b)
    for q in seqs:
        q.output_ids.append(7)
    return seqs


def test_the_step_ahead_is_the_decode_step_schedule_makes_one_token_later() -> None:
    s = _scheduler()
    seqs = _decoding(s, [15, 16, 31])  # the token drawn next crosses a page boundary for two of them
    cur = s.schedule()
    assert cur is not None and cur.phase == Phase.DECODE
    ahead = s.schedule_ahead(cur, finishing={"r1"})
    assert ahead is not None and ahead.phase == Phase.DECODE
    assert [q.request_id for q in ahead.seqs] == ["r0", "r2"]
    assert all(st.token_ids == [0] for st in ahead.steps)  # placeholders
    for q in seqs:  # the tokens of `cur` arrive; r1 finishes
        q.output_ids.append(11)
    s.finish(seqs[1])
    later = s.schedule()
    assert later is not None and later.phase == Phase.DECODE and later.seqs == ahead.seqs
    for a, b in zip(ahead.steps, later.steps):
        assert (a.slot, a.start_pos) == (b.slot, b.start_pos)
        assert list(a.page_table) == list(b.page_table)
        assert len(a.page_table) * 16 > a.start_pos  # the pages cover the new token
    assert [st.token_ids for st in later.steps] == [[11], [11]]


def test_there_is_no_step_ahead_unless_the_next_step_is_the_same_decode() -> None:
    s = _scheduler()
    _decoding(s, [5, 6])
    cur = s.schedule()
    assert cur is not None
    assert s.schedule_ahead(cur, finishing={"r0", "r1"}) is None  # every sequence ends
    s.add(Sequence("late", [3, 4, 5], SamplingParams(), max_len=10))
    assert s.schedule_ahead(cur, finishing=set()) is None  # an admission comes first
    s2 = _scheduler()
    q = Sequence("p", list(range(3, 20)), SamplingParams(), max_len=40)
    s2.add(q)
    pre = s2.schedule()
    assert pre is not None and s2.schedule_ahead(pre, finishing=set()) is None  # not a decode step
    s3 = _scheduler(pages=8)
    seqs = _decoding(s3, [5])
    d = s3.schedule()
    assert d is not None
    s3.finish(seqs[0])  # finished while its step ran (a cancel): the batch is no longer the running set
    assert s3.schedule_ahead(d, finishing=set()) is None


# ---- the engine, async on vs off (host backend) ------------------------------------------------------

def _workload(tok_stop: int, text_stop: str) -> list[GenerationRequest]:
    """Greedy and seeded sampled requests, EOS honoured or ignored, stop tokens, a stop string, min_tokens,
    logprobs: every way a request ends, in one batch."""
    rng = np.random.default_rng(3)
    out = []
    for i in range(12):
        ids = tuple(int(t) for t in rng.integers(3, 2048, int(rng.integers(3, 60))))
        sampled = i % 3 == 2
        params = SamplingParams(max_tokens=int(rng.integers(3, 28)), ignore_eos=i % 4 != 0,
                                temperature=0.8 if sampled else 0.0, seed=500 + i if sampled else None,
                                logprobs=2 if i % 5 == 1 else None)
        out.append(GenerationRequest(f"w{i}", prompt_ids=ids, params=params))
    out.append(GenerationRequest("stoptok", prompt="The weather today", params=SamplingParams(
        max_tokens=20, ignore_eos=True, stop_token_ids=(tok_stop,))))
    out.append(GenerationRequest("stoptok-min", prompt="The weather today", params=SamplingParams(
        max_tokens=20, ignore_eos=True, stop_token_ids=(tok_stop,), min_tokens=12)))
    out.append(GenerationRequest("stopstr", prompt="The weather today", params=SamplingParams(
        max_tokens=20, ignore_eos=True, stop=(text_stop,))))
    out.append(GenerationRequest("long", prompt="Once upon a time", params=SamplingParams(
        max_tokens=40, ignore_eos=True)))
    return out


def _run(bundle: Path, mode: str, reqs: list[GenerationRequest], stagger: bool,
         solo: tuple[GenerationRequest, ...] = ()) -> tuple[dict[str, Event], dict]:
    """``reqs`` submitted together (``stagger``: in groups), then each of ``solo`` alone: a lone decoding request
    always has its next step prepared ahead, so a stop token there always drops one (timing-independent)."""
    eng = ServingEngine(bundle, RuntimeOptions(async_scheduling=mode)).start()
    counters: dict[int, list[int]] = {}  # the device sampler's (seed, counter) key of every row drawn
    launch = eng.runner.launch

    def spy(phase, steps, rows):  # type: ignore[no-untyped-def]
        for r in rows:
            counters.setdefault(r.seed, []).append(r.counter)
        return launch(phase, steps, rows)

    eng.runner.launch = spy  # type: ignore[method-assign]
    try:
        sink = Collect(len(reqs))
        for i, r in enumerate(reqs):
            eng.submit(r, sink)
            if stagger and i % 5 == 4:
                time.sleep(0.05)  # arrivals while sequences decode: steps ahead are dropped for them
        assert sink.done.wait(120)
        finals = dict(sink.finals)
        for r in solo:
            finals[r.request_id] = generate(eng, [r])[0]
        deadline = time.monotonic() + 10
        while eng.stats()["slots_in_use"] or eng.stats()["kv_pages_in_use"]:
            assert time.monotonic() < deadline, eng.stats()
            time.sleep(0.02)
        for seed, cs in counters.items():  # each row draws the position after the previous one's
            assert cs == list(range(cs[0], cs[0] + len(cs))), (seed, cs)
        return finals, eng.stats()
    finally:
        eng.shutdown()


def test_async_scheduling_gives_the_tokens_of_one_step_at_a_time(default_bundle: Path) -> None:
    base = generate(eng := ServingEngine(default_bundle, RuntimeOptions(async_scheduling="off")).start(),
                    [GenerationRequest("b", prompt="The weather today",
                                       params=SamplingParams(max_tokens=20, ignore_eos=True))])[0]
    assert not eng.async_scheduling
    eng.shutdown()
    reqs = _workload(base.output_ids[6], base.text.strip()[4:7])
    solo = (GenerationRequest("solo-stoptok", prompt="The weather today", params=SamplingParams(
        max_tokens=20, ignore_eos=True, stop_token_ids=(base.output_ids[6],))),)
    off, off_stats = _run(default_bundle, "off", reqs, stagger=True, solo=solo)
    on, on_stats = _run(default_bundle, "on", reqs, stagger=True, solo=solo)
    for r in (*reqs, *solo):
        a, b = off[r.request_id], on[r.request_id]
        assert (b.finish_reason, b.output_ids, b.text, b.logprobs) == (a.finish_reason, a.output_ids, a.text,
                                                                         a.logprobs), r.request_id
    reasons = {ev.finish_reason for ev in on.values()}
    assert {"stop", "length"} <= reasons
    assert on["stoptok"].finish_reason == "stop" and len(on["stoptok-min"].output_ids) > 12
    assert on["stopstr"].finish_reason == "stop"
    assert on["solo-stoptok"].finish_reason == "stop"
    assert len(on["solo-stoptok"].output_ids) == base.output_ids.index(base.output_ids[6]) + 1
    assert off_stats.get("async_steps", {}) == {}
    steps = on_stats["async_steps"]
    assert steps.get("launched", 0) > 10 and steps.get("dropped", 0) >= 1, steps  # solo-stoptok's stop at least
    assert on_stats["tokens_generated"] == off_stats["tokens_generated"]


def test_a_cancel_and_a_client_gone_while_a_step_runs_ahead(default_bundle: Path) -> None:
    eng = ServingEngine(default_bundle, RuntimeOptions(async_scheduling="on")).start()
    try:
        got3 = threading.Event()
        events: list[Event] = []

        def sink(ev: Event) -> None:
            events.append(ev)
            if len(events) == 3:
                got3.set()

        calls: list[Event] = []
        gone = threading.Event()

        def bad_sink(ev: Event) -> None:
            calls.append(ev)
            if ev.final:
                gone.set()
            if len(calls) >= 4:
                raise ConnectionError("client went away")

        eng.submit(GenerationRequest("long", prompt="The weather today", params=SamplingParams(
            max_tokens=200, ignore_eos=True)), sink)
        eng.submit(GenerationRequest("gone", prompt="hello there", params=SamplingParams(
            max_tokens=200, ignore_eos=True)), bad_sink)
        assert got3.wait(30) and gone.wait(30)
        eng.cancel("long")
        solo = generate(eng, [GenerationRequest("after", prompt="Once upon a time",
                                            params=SamplingParams(max_tokens=10, ignore_eos=True))])[0]
        assert solo.finish_reason == "length" and len(solo.output_ids) == 10
        deadline = time.monotonic() + 10
        while eng.stats()["slots_in_use"] or eng.stats()["kv_pages_in_use"]:
            assert time.monotonic() < deadline, eng.stats()
            time.sleep(0.02)
        finals = [e for e in events if e.final]
        assert len(finals) == 1 and finals[0].finish_reason == "cancelled"
        assert [e.final for e in calls].count(True) == 1 and calls[-1].finish_reason == "cancelled"
        assert len(calls) == 5  # three token events, the one that failed, the final
        assert eng.stats()["async_steps"].get("launched", 0) > 0
    finally:
        eng.shutdown()


def test_shutdown_with_a_step_ahead_in_flight_sends_each_request_one_final(default_bundle: Path) -> None:
    eng = ServingEngine(default_bundle, RuntimeOptions(async_scheduling="on")).start()
    finals: list[Event] = []
    started = threading.Event()

    def sink(ev: Event) -> None:
        if ev.final:
            finals.append(ev)
        elif len(ev.token_ids) and ev.request_id == "a":
            started.set()

    for rid in ("a", "b"):
        eng.submit(GenerationRequest(rid, prompt="The weather today", params=SamplingParams(
            max_tokens=400, ignore_eos=True)), sink)
    assert started.wait(30)
    time.sleep(0.1)
    eng.shutdown()
    assert eng._thread is not None and not eng._thread.is_alive()
    assert sorted(e.request_id for e in finals) == ["a", "b"]
    assert all(e.finish_reason == "cancelled" for e in finals)


@pytest.mark.parametrize("at", [4, 5])
def test_a_failed_launch_of_a_step_ahead_fails_only_its_sequences(default_bundle: Path,
                                                                   monkeypatch: pytest.MonkeyPatch, at: int) -> None:
    """Steps 0..1: the prefill of all four and the first decode step; from step 2 on, steps launched ahead."""
    monkeypatch.setenv(FAULT_ENV, f"launch@{at}")
    eng = ServingEngine(default_bundle, RuntimeOptions(async_scheduling="on"))
    sink = Collect(4)
    for i in range(4):
        eng.submit(GenerationRequest(f"r{i}", prompt_ids=tuple(range(3, 12 + i)), params=SamplingParams(
            max_tokens=40, ignore_eos=True, temperature=0)), sink)
    eng.start()
    try:
        assert sink.done.wait(60)
        for rid, ev in sink.finals.items():
            assert ev.finish_reason == "error" and "injected launch failure" in (ev.error or ""), ev
            assert sink.tokens(rid) == at - 1 + 1  # the prefill's token and one per decode step before the failed one
        assert eng.fatal is None and eng.stats()["async_steps"]["launched"] == at - 2
        again = generate(eng, [GenerationRequest("after", prompt_ids=(3, 4, 5), params=SamplingParams(max_tokens=3))])
        assert again[0].finish_reason == "length"
    finally:
        eng.shutdown()


def test_the_option_is_validated_and_reaches_the_engine(default_bundle: Path) -> None:
    from deploy.triton_adapter import ParameterError, parse_parameters

    with pytest.raises(ConfigError, match="async_scheduling"):
        RuntimeOptions(async_scheduling="sometimes")
    cfg = {"parameters": {"engine_dir": {"string_value": str(default_bundle)},
                          "async_scheduling": {"string_value": "on"}}}
    params = parse_parameters(cfg, default_bundle.parent)
    assert params.runtime_options().async_scheduling == "on"
    with pytest.raises(ParameterError, match="async_scheduling"):
        parse_parameters({"parameters": {"engine_dir": {"string_value": str(default_bundle)},
                                         "async_scheduling": {"string_value": "yes"}}}, default_bundle.parent)
    eng = ServingEngine(default_bundle, RuntimeOptions(warmup=False))
    assert not eng.async_scheduling and not eng.runner.supports_ahead  # auto: off on a host backend


# ---- the cuda backend's half, on its stub (host only) ------------------------------------------------

def _stub(max_batch: int = 16):
    from benchmarks.gpu_decode_step import qwen35_moe_config
    from benchmarks.host_prepare_cpu import stub_backend

    return stub_backend(qwen35_moe_config(4), max_batch, 2048 + 64, max_batch * 140)


@pytest.mark.parametrize("B", [1, 3, 16])
def test_a_step_prepared_ahead_uploads_the_bytes_prepare_would_once_its_ids_are_patched(B: int) -> None:
    from benchmarks.host_prepare_cpu import decode_step
    from hybrid_runtime.ops.base import SeqStep

    be = _stub()
    steps, rows = decode_step(be, B, 1500, seed=B, logprobs=B == 3)
    ref = be.prepare(Phase.DECODE, steps, rows, False)
    want = bytes(ref.host_in.array[:ref.upload_bytes])
    before = (dict(be.graph_stats.replays), dict(be.dispatcher.plans))
    placeholders = [SeqStep(s.slot, s.page_table, s.start_pos, [0]) for s in steps]
    ctx = be.prepare_ahead(Phase.DECODE, placeholders, rows)
    assert ctx.host_in is not ref.host_in  # the other pinned buffer: the step in flight's stays as it was
    assert bytes(ref.host_in.array[:ref.upload_bytes]) == want
    be.patch_ids(ctx, np.array([s.token_ids[0] for s in steps]))
    assert bytes(ctx.host_in.array[:ctx.upload_bytes]) == want
    assert ctx.graph is ref.graph and ctx.plan == ref.plan
    assert dict(be.graph_stats.replays) != before[0]  # counted as prepare counts
    nxt = be.prepare_ahead(Phase.DECODE, placeholders, rows)
    assert nxt.host_in is ref.host_in  # alternates
    be.abandon(nxt)
    be.abandon(ctx)
    assert (dict(be.graph_stats.replays), dict(be.dispatcher.plans)) == before  # both counts taken back


def test_patch_ids_refuses_what_prepare_refuses() -> None:
    from benchmarks.host_prepare_cpu import decode_step

    be = _stub()
    steps, rows = decode_step(be, 2, 100, seed=1)
    ctx = be.prepare_ahead(Phase.DECODE, steps, rows)
    with pytest.raises(ValueError, match="2 sequences"):
        be.patch_ids(ctx, np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="vocabulary"):
        be.patch_ids(ctx, np.array([1, be.cfg.vocab_size]))
    ctx.launched = True
    with pytest.raises(ValueError, match="already launched"):
        be.patch_ids(ctx, np.array([1, 2]))
    be.abandon(ctx)  # a launched step keeps its counts
    assert sum(be.graph_stats.replays.values()) == 1
