"""The Triton adapter without a server: parameter and request parsing, replies, cancellation polling,
metrics mirroring, and model.py itself driven through a stubbed ``triton_python_backend_utils``."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from deploy.inflight import CancelWatcher, SendQueue, TerminationSignals
from deploy.triton_adapter import (
    LogprobsEncoder,
    ParameterError,
    ParsedRequest,
    ReplyBuilder,
    parse_parameters,
    parse_request,
)
from deploy.triton_metrics import TritonMetrics
from hybrid_runtime.metrics import LATENCY_BUCKETS
from hybrid_runtime.sampler import TokenLogprobs
from hybrid_runtime.sampling import RequestValidationError, SamplingParams
from hybrid_runtime.serving import Event

REPO = Path(__file__).resolve().parents[2]
MODEL_PY = REPO / "model_repository" / "hybrid_llm" / "1" / "model.py"


# ---- parameters ---------------------------------------------------------------------------------------

def _config(**params: str) -> dict:
    return {"parameters": {k: {"string_value": v} for k, v in params.items()}}


def test_parameters_defaults_and_relative_engine_dir(tmp_path: Path) -> None:
    model_dir = tmp_path / "repo" / "hybrid_llm"
    model_dir.mkdir(parents=True)
    (tmp_path / "engines" / "default").mkdir(parents=True)
    p = parse_parameters(_config(), model_dir)
    assert p.engine_dir == (tmp_path / "engines" / "default").resolve()
    assert (p.max_batch_size, p.multi_block_mode, p.profile_pinning, p.default_max_tokens) == (0, "auto",
                                                                                               "per_context", 16)
    opts = parse_parameters(_config(engine_dir=str(tmp_path), max_batch_size="4", multi_block_mode="OFF",
                                    profile_pinning="single_context", default_max_tokens="7",
                                    kv_cache_bytes="2M", log_level="debug", intra_op_threads="1",
                                    EXECUTION_ENV_PATH="/x.tar.gz"), model_dir)
    assert opts.engine_dir == tmp_path and opts.log_level == "debug"
    ro = opts.runtime_options()
    assert (ro.max_batch_size, ro.multi_block_mode, ro.profile_pinning, ro.default_max_tokens, ro.kv_cache_bytes,
            ro.intra_op_threads) == (4, "off", "single_context", 7, 2 * 1024 * 1024, 1)
    assert parse_parameters(_config(engine_dir=str(tmp_path), max_batch_size=""), model_dir).max_batch_size == 0


@pytest.mark.parametrize(("key", "value", "expect"), [
    ("max_batch_size", "-1", "integer >= 0"),
    ("max_batch_size", "four", "integer >= 0"),
    ("multi_block_mode", "sometimes", "auto, on, off"),
    ("profile_pinning", "pinned", "per_context, single_context"),
    ("default_max_tokens", "0", "integer >= 1"),
    ("kv_cache_bytes", "lots", "byte count"),
    ("log_level", "chatty", "debug, info, warning, error"),
    ("intra_op_threads", "1.5", "integer >= 0"),
    ("heap_snapshot_period_s", "0", "integer >= 1"),
    ("heap_trim_interval_s", "-5", "seconds >= 0"),
    ("heap_trim_interval_s", "nan", "seconds >= 0"),
    ("heap_trim_interval_s", "often", "seconds >= 0"),
    ("warmup", "maybe", "true or false"),
    ("packed_weights", "half", "auto, off, linears, experts, all, dual"),
])
def test_bad_parameter_names_key_and_fix(tmp_path: Path, key: str, value: str, expect: str) -> None:
    with pytest.raises(ParameterError) as e:
        parse_parameters(_config(engine_dir=str(tmp_path), **{key: value}), tmp_path)
    msg = str(e.value)
    assert key in msg and repr(value) in msg and expect in msg and "config.pbtxt" in msg


def test_heap_trim_interval_reaches_the_runtime(tmp_path: Path) -> None:
    assert parse_parameters(_config(engine_dir=str(tmp_path)), tmp_path).runtime_options().heap_trim_interval_s == 60
    p = parse_parameters(_config(engine_dir=str(tmp_path), heap_trim_interval_s="2.5"), tmp_path)
    assert p.heap_trim_interval_s == 2.5 and p.runtime_options().heap_trim_interval_s == 2.5
    assert parse_parameters(_config(engine_dir=str(tmp_path), heap_trim_interval_s="0"),
                            tmp_path).runtime_options().heap_trim_interval_s == 0


def test_warmup_parameter_reaches_the_runtime(tmp_path: Path) -> None:
    assert parse_parameters(_config(engine_dir=str(tmp_path)), tmp_path).runtime_options().warmup is True
    for text, want in (("false", False), ("0", False), ("True", True), ("no", False), (" on ", True)):
        assert parse_parameters(_config(engine_dir=str(tmp_path), warmup=text),
                                tmp_path).runtime_options().warmup is want, text


def test_packed_weights_parameter_reaches_the_runtime(tmp_path: Path) -> None:
    assert parse_parameters(_config(engine_dir=str(tmp_path)), tmp_path).runtime_options().packed_weights == "auto"
    for text, want in (("all", "all"), (" Experts ", "experts"), ("LINEARS", "linears"), ("", "auto"),
                       ("off", "off"), ("Auto", "auto"), ("Dual", "dual")):
        assert parse_parameters(_config(engine_dir=str(tmp_path), packed_weights=text),
                                tmp_path).runtime_options().packed_weights == want, text
    shipped = (REPO / "model_repository" / "hybrid_llm" / "config.pbtxt").read_text()
    assert 'key: "packed_weights"' in shipped  # documented where a deployment sets it


def test_heap_debugging_parameters(tmp_path: Path) -> None:
    model_dir = tmp_path / "hybrid_llm"
    model_dir.mkdir()
    off = parse_parameters(_config(engine_dir=str(tmp_path), heap_debug_dir=""), model_dir)
    assert off.heap_debug_dir is None and off.heap_snapshot_period_s == 300
    on = parse_parameters(_config(engine_dir=str(tmp_path), heap_debug_dir="heap", heap_snapshot_period_s="60"),
                          model_dir)
    assert on.heap_debug_dir == (model_dir / "heap").resolve() and on.heap_snapshot_period_s == 60
    assert parse_parameters(_config(engine_dir=str(tmp_path), heap_debug_dir=str(tmp_path / "h")),
                            model_dir).heap_debug_dir == tmp_path / "h"


def test_unknown_parameter_and_missing_engine_dir(tmp_path: Path) -> None:
    with pytest.raises(ParameterError, match=r"unknown parameter\(s\) \['max_batch'\]"):
        parse_parameters(_config(engine_dir=str(tmp_path), max_batch="4"), tmp_path)
    with pytest.raises(ParameterError, match="not a directory"):
        parse_parameters(_config(engine_dir=str(tmp_path / "nope")), tmp_path)


# ---- requests -----------------------------------------------------------------------------------------

def _getter(**tensors: object):
    arrays = {}
    for name, value in tensors.items():
        arrays[name] = value if isinstance(value, np.ndarray) else np.array(value)
    return arrays.get


def _bytes(*items: bytes) -> np.ndarray:
    return np.array(list(items), dtype=np.object_)


def test_text_request_defaults_follow_vllm() -> None:
    r = parse_request(_getter(text_input=_bytes(b"hello")), default_max_tokens=9)
    assert r == ParsedRequest("hello", None, SamplingParams(max_tokens=9), stream=False, prepend_prompt=True)
    r = parse_request(_getter(text_input=_bytes(b"hi"), stream=np.array([True])))
    assert r.stream and not r.prepend_prompt
    r = parse_request(_getter(text_input=_bytes(b"hi"), exclude_input_in_output=np.array([True])))
    assert not r.prepend_prompt
    with pytest.raises(RequestValidationError, match="not allowed when streaming"):
        parse_request(_getter(text_input=_bytes(b"hi"), stream=np.array([True]),
                              exclude_input_in_output=np.array([False])))


def test_ids_request_and_sampling() -> None:
    sp = json.dumps({"temperature": "0.5", "top_k": "-1", "max_tokens": "12", "seed": "3", "ignore_eos": "true"})
    r = parse_request(_getter(input_ids=np.array([5, 6, 7], dtype=np.int32), sampling_parameters=_bytes(sp.encode())))
    assert r.prompt is None and r.prompt_ids == (5, 6, 7)
    assert r.params == SamplingParams(max_tokens=12, temperature=0.5, top_k=0, seed=3, ignore_eos=True)
    r = parse_request(_getter(text_input=_bytes(b"x"), max_tokens=np.array([4], dtype=np.int32)))
    assert r.params.max_tokens == 4
    r = parse_request(_getter(text_input=_bytes(b"x"), max_tokens=np.array([4], dtype=np.int32),
                              sampling_parameters=_bytes(b'{"max_tokens": 4}')))
    assert r.params.max_tokens == 4
    assert r.generation_request("req-1").prompt == "x"


@pytest.mark.parametrize(("tensors", "match"), [
    ({}, "exactly one of text_input or input_ids"),
    ({"text_input": _bytes(b"a"), "input_ids": np.array([1], dtype=np.int32)}, "not both"),
    ({"text_input": _bytes(b"\xff\xfe")}, "not valid UTF-8"),
    ({"text_input": _bytes(b"a", b"b")}, "exactly one element"),
    ({"input_ids": np.array([1.0], dtype=np.float32)}, "wrong data type"),
    ({"text_input": _bytes(b"a"), "max_tokens": np.array([2.0], dtype=np.float32)}, "wrong data type"),
    ({"text_input": _bytes(b"a"), "max_tokens": np.array([0], dtype=np.int32)}, "must be >= 1"),
    ({"text_input": _bytes(b"a"), "max_tokens": np.array([3], dtype=np.int32),
      "sampling_parameters": _bytes(b'{"max_tokens": 5}')}, "conflicts"),
    ({"text_input": _bytes(b"a"), "sampling_parameters": _bytes(b"{not json")}, "not valid JSON"),
    ({"text_input": _bytes(b"a"), "sampling_parameters": _bytes(b'{"temprature": 1}')}, "unknown sampling"),
    ({"text_input": _bytes(b"a"), "sampling_parameters": _bytes(b'{"top_p": 2}')}, "top_p"),
    ({"text_input": _bytes(b"a"), "stream": np.array([1], dtype=np.int32)}, "wrong data type"),
])
def test_invalid_requests(tensors: dict, match: str) -> None:
    with pytest.raises(RequestValidationError, match=match):
        parse_request(_getter(**tensors))


# ---- replies ------------------------------------------------------------------------------------------

def _events(rid: str = "r") -> list[Event]:
    return [Event(rid, text="Hel", token_ids=(1,)), Event(rid, text="", token_ids=(2,)),
            Event(rid, text="lo", token_ids=(3,)),
            Event(rid, text="Hello", final=True, finish_reason="stop", output_ids=(1, 2, 3, 9))]


def _text(reply) -> str:
    return reply.outputs["text_output"][0].decode()


def test_streamed_replies_are_deltas_and_final_carries_the_rest() -> None:
    samples: list[tuple[str, float]] = []
    b = ReplyBuilder(ParsedRequest("p", None, SamplingParams(), True, False), "p",
                     lambda kind, s: samples.append((kind, s)))
    replies = [b.on_event(ev) for ev in _events()]
    assert [_text(r) for r in replies] == ["Hel", "", "lo", ""]
    assert [r.outputs["output_ids"].tolist() for r in replies] == [[1], [2], [3], [9]]  # EOS id 9 comes last
    assert [r.final for r in replies] == [False, False, False, True]
    assert replies[-1].outputs["finish_reason"][0] == b"stop" and "finish_reason" not in replies[0].outputs
    assert [k for k, _ in samples] == ["ttft", "itl", "itl"]


def test_the_token_reaching_max_tokens_goes_out_with_the_final_flag() -> None:
    b = ReplyBuilder(ParsedRequest("p", None, SamplingParams(max_tokens=3), True, False))
    events = [*_events()[:3], Event("r", text="Hello", final=True, finish_reason="length", output_ids=(1, 2, 3))]
    replies = [b.on_event(ev) for ev in events]
    assert replies[2] is None
    assert [_text(r) for r in (replies[0], replies[1], replies[3])] == ["Hel", "", "lo"]
    assert replies[3].final and replies[3].outputs["output_ids"].tolist() == [3]
    assert replies[3].outputs["finish_reason"][0] == b"length"


def test_unstreamed_reply_is_one_final_with_prompt() -> None:
    b = ReplyBuilder(ParsedRequest("Say: ", None, SamplingParams(), False, True), "Say: ")
    replies = [b.on_event(ev) for ev in _events()]
    assert replies[:3] == [None, None, None]
    assert _text(replies[3]) == "Say: Hello" and replies[3].outputs["output_ids"].tolist() == [1, 2, 3, 9]
    b = ReplyBuilder(ParsedRequest("x", None, SamplingParams(), False, False), "x")
    assert _text(b.on_event(_events()[-1])) == "Hello"


def _lp(i: int) -> TokenLogprobs:
    return TokenLogprobs(-float(i), ((i, -float(i)),))


def test_logprobs_and_prompt_length_outputs() -> None:
    enc = LogprobsEncoder(lambda t: bytes([97 + t]))
    lps = {1: _lp(1), 2: _lp(2), 3: _lp(3), 9: _lp(9)}
    events = [Event(e.request_id, e.text, e.token_ids, e.final, e.finish_reason, e.error, e.output_ids,
                    num_prompt_tokens=7 if e.final else 0,
                    logprobs=tuple(lps[i] for i in (e.output_ids if e.final else e.token_ids)))
              for e in _events()]

    def ids_of(reply) -> list[int]:
        return [d["token_id"] for d in json.loads(reply.outputs["output_logprobs"][0])]

    for stream in (True, False):
        b = ReplyBuilder(ParsedRequest("p", None, SamplingParams(logprobs=1), stream, False), "p", logprobs=enc)
        replies = [r for r in (b.on_event(ev) for ev in events) if r is not None]
        assert [ids_of(r) for r in replies] == [r.outputs["output_ids"].tolist() for r in replies]
        assert [i for r in replies for i in ids_of(r)] == [1, 2, 3, 9]
        assert replies[-1].outputs["num_input_tokens"].tolist() == [7]
        assert all("num_input_tokens" not in r.outputs for r in replies[:-1])
        doc = json.loads(replies[-1].outputs["output_logprobs"][0])[-1]
        assert doc == {"token_id": 9, "token": "j", "bytes": [106], "logprob": -9.0,
                       "top_logprobs": [{"token_id": 9, "token": "j", "bytes": [106], "logprob": -9.0}]}
    # Not asked for: no output_logprobs at all, even with an encoder.
    b = ReplyBuilder(ParsedRequest("p", None, SamplingParams(), True, False), "p", logprobs=enc)
    assert all("output_logprobs" not in b.on_event(ev).outputs for ev in _events())


def test_error_and_cancelled_finals() -> None:
    b = ReplyBuilder(ParsedRequest("x", None, SamplingParams(), True, False))
    r = b.on_event(Event("r", final=True, finish_reason="error", error="boom"))
    assert r.final and r.error == "boom" and r.outputs == {}
    r = b.on_event(Event("r", final=True, finish_reason="cancelled", output_ids=()))
    assert r.final and r.error is None and r.outputs["finish_reason"][0] == b"cancelled"
    assert "output_ids" not in r.outputs  # no ids: no zero-byte tensor (Triton 2.51's HTTP frontend leaks one)


def test_no_reply_carries_a_zero_byte_tensor() -> None:
    """Triton 2.51's HTTP frontend leaks ~80 bytes for every zero-byte output buffer of a response (an
    ``OutputInfo`` its allocator makes and the core never releases when there is no buffer): every tensor the
    model sends must hold at least one byte, in every path of the reply builder."""
    from deploy.triton_adapter import outputs

    assert "output_ids" not in outputs("", ()) and outputs("", (7,))["output_ids"].tolist() == [7]
    max_len = Event("r", text="Hello", final=True, finish_reason="length", output_ids=(1, 2, 3))
    stop_all_sent = Event("r", text="Hello", final=True, finish_reason="stop", output_ids=(1, 2, 3))
    for stream, events, params in ((True, _events(), SamplingParams()),
                                   (True, [*_events()[:3], max_len], SamplingParams(max_tokens=3)),
                                   (True, [*_events()[:3], stop_all_sent], SamplingParams()),
                                   (False, _events(), SamplingParams()),
                                   (True, [Event("r", final=True, finish_reason="cancelled")], SamplingParams()),
                                   (False, [Event("r", final=True, finish_reason="cancelled")], SamplingParams())):
        b = ReplyBuilder(ParsedRequest("p", None, params, stream, False), "p")
        for reply in filter(None, (b.on_event(ev) for ev in events)):
            for name, arr in reply.outputs.items():
                assert arr.size and (arr.dtype != np.object_ or all(isinstance(v, bytes) for v in arr.reshape(-1))), \
                    (name, arr)


# ---- cancellation -------------------------------------------------------------------------------------

def test_cancel_watcher_cancels_once_and_skips_finished() -> None:
    flags = {"a": False, "b": True, "c": True}
    cancelled: list[str] = []

    def is_cancelled(handle: str) -> bool:
        if handle == "c":
            raise RuntimeError("request already released")
        return flags[handle]

    w = CancelWatcher(is_cancelled, cancelled.append)
    for rid in ("a", "b", "c"):
        w.add(rid, rid)
    assert w.poll_once() == []  # not armed (not submitted) yet
    for rid in ("a", "b", "c", "gone"):
        w.arm(rid)
    assert w.poll_once() == ["b"]
    assert w.poll_once() == []  # cancelled once only
    flags["a"] = True
    w.remove("a")
    assert w.poll_once() == [] and cancelled == ["b"] and len(w) == 2


def test_remove_waits_for_a_running_is_cancelled_and_no_call_follows() -> None:
    """Triton frees a request's response factory after its final response: is_cancelled must not run then."""
    calls: list[str] = []
    entered, release = threading.Event(), threading.Event()

    def is_cancelled(handle: str) -> bool:
        calls.append("start")
        entered.set()
        release.wait(5)
        calls.append("end")
        return False

    w = CancelWatcher(is_cancelled, lambda rid: None)
    w.add("a", "a")
    w.arm("a")
    poller = threading.Thread(target=w.poll_once)
    poller.start()
    assert entered.wait(5)
    remover = threading.Thread(target=lambda: (w.remove("a"), calls.append("removed")))
    remover.start()
    remover.join(0.2)
    assert remover.is_alive()  # blocked until is_cancelled returns
    release.set()
    remover.join(5)
    poller.join(5)
    assert calls == ["start", "end", "removed"]
    assert w.poll_once() == [] and calls == ["start", "end", "removed"]


def test_cancel_watcher_drains_when_the_model_unloads() -> None:
    ready = [True]
    cancelled: list[str] = []
    w = CancelWatcher(lambda h: False, cancelled.append, model_ready=lambda: ready[0], ready_period_s=0.0)
    for rid in ("a", "b"):
        w.add(rid, rid)
        w.arm(rid)
    assert w.poll_once() == [] and not w.draining
    ready[0] = False
    assert sorted(w.poll_once()) == ["a", "b"] and w.draining
    w.add("c", "c")
    w.arm("c")
    assert w.poll_once() == ["c"]  # anything still arriving is cancelled too
    broken = CancelWatcher(lambda h: False, cancelled.append, model_ready=lambda: 1 / 0, ready_period_s=0.0)
    broken.add("d", "d")
    broken.arm("d")
    assert broken.poll_once() == ["d"]  # the server going away counts as not ready


def test_cancel_watcher_drains_on_a_termination_signal_without_asking_readiness() -> None:
    """A signal to the stub drains every request at once, and readiness is never asked after it (once the
    server is exiting, Triton 2.51's readiness call can crash the stub: deploy/README.md)."""
    signum: list[int] = []
    asked: list[float] = []

    def ready() -> bool:
        asked.append(time.monotonic())
        assert not signum, "readiness asked after the termination signal"
        return True

    cancelled: list[str] = []
    w = CancelWatcher(lambda h: False, cancelled.append, model_ready=ready, ready_period_s=0.0,
                      terminated=lambda: signum[0] if signum else None)
    for rid in ("a", "b"):
        w.add(rid, rid)
        w.arm(rid)
    assert w.poll_once() == [] and not w.draining and len(asked) == 1
    signum.append(signal.SIGTERM)
    assert sorted(w.poll_once()) == ["a", "b"] and w.draining
    w.add("c", "c")
    w.arm("c")
    assert w.poll_once() == ["c"] and len(asked) == 1 and sorted(cancelled) == ["a", "b", "c"]


def test_cancel_watcher_prefers_a_signal_that_arrives_while_readiness_is_asked(
        caplog: pytest.LogCaptureFixture) -> None:
    """The stub's signal lands while the watcher asks readiness (the server, signalled next, already unready): the
    drain is the signal's (its log line), not reported as an unload."""
    import logging

    signum: list[int] = []

    def ready() -> bool:
        signum.append(signal.SIGTERM)  # delivered meanwhile
        return False

    cancelled: list[str] = []
    w = CancelWatcher(lambda h: False, cancelled.append, model_ready=ready, ready_period_s=0.0,
                      terminated=lambda: signum[0] if signum else None)
    w.add("a", "a")
    w.arm("a")
    with caplog.at_level(logging.WARNING, logger="deploy.inflight"):
        assert w.poll_once() == ["a"] and w.draining
    assert "signal 15 received" in caplog.text and "being unloaded" not in caplog.text


def test_signal_pending_follows_a_real_process() -> None:
    """``deploy.triton.signal_pending`` (TritonServer.stop waits on it before signalling the server): True while a
    child blocks the SIGTERM sent to it, False once it has taken it (a handler that ignores it), False for a process
    that is gone."""
    import subprocess

    from deploy.triton import signal_pending

    code = ("import signal, sys\n"
            "signal.signal(signal.SIGTERM, lambda *a: None)\n"
            "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
            "print('ready', flush=True)\n"
            "sys.stdin.readline()\n"
            "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})\n"
            "print('taken', flush=True)\n"
            "sys.stdin.readline()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdin is not None
        assert p.stdout.readline().strip() == "ready"
        assert not signal_pending(p.pid, signal.SIGTERM)
        os.kill(p.pid, signal.SIGTERM)
        assert signal_pending(p.pid, signal.SIGTERM) and not signal_pending(p.pid, signal.SIGINT)
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "taken"
        assert not signal_pending(p.pid, signal.SIGTERM) and p.poll() is None
    finally:
        p.kill()
        p.wait(10)
    assert not signal_pending(p.pid, signal.SIGTERM)


def test_termination_signals_are_seen_from_another_thread_and_uninstalled() -> None:
    before = {sig: signal.getsignal(sig) for sig in TerminationSignals.SIGNALS}
    sigs = TerminationSignals()
    assert sigs.install()
    try:
        assert sigs.received() is None
        os.kill(os.getpid(), signal.SIGTERM)  # ignored by the process: only recorded
        seen: list[int | None] = []
        t = threading.Thread(target=lambda: seen.append(sigs.received()))
        t.start()
        t.join(5)
        assert seen == [signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt either; the first signal stays the answer
        time.sleep(0.01)
        assert sigs.received() == signal.SIGTERM
    finally:
        sigs.uninstall()
    assert {sig: signal.getsignal(sig) for sig in TerminationSignals.SIGNALS} == before
    assert signal.set_wakeup_fd(-1) == -1  # the wakeup fd was cleared

    elsewhere: list[bool] = []
    t = threading.Thread(target=lambda: elsewhere.append(TerminationSignals().install()))
    t.start()
    t.join(5)
    assert elsewhere == [False]  # signal handlers can only be set on the main thread


def test_cancel_watcher_thread_polls() -> None:
    hit = threading.Event()
    w = CancelWatcher(lambda h: True, lambda rid: hit.set(), period_s=0.01).start()
    w.add("x", object())
    w.arm("x")
    try:
        assert hit.wait(2.0)
    finally:
        w.stop()


def test_send_queue_keeps_order_reports_failures_and_drains_on_close() -> None:
    sent: list[int] = []
    failed: list[str] = []

    def send(i: int) -> None:
        if i == 2:
            raise RuntimeError("client gone")
        sent.append(i)

    q = SendQueue(lambda rid, e: failed.append(f"{rid}: {e}")).start()
    for i in range(5):
        q.put(f"r{i}", lambda i=i: send(i))
    q.close()
    assert sent == [0, 1, 3, 4] and failed == ["r2: client gone"]


def test_send_queue_gate_holds_sends_until_the_engine_waits_on_its_device() -> None:
    """With a gate (ServingEngine.device_wait) a send waits until the gate is set (the engine blocked on
    its GPU, the GIL free) — or until the timeout, so an idle engine never holds a reply back for long."""
    gate = threading.Event()
    sent: list[int] = []
    done = threading.Event()

    def send(i: int) -> None:
        sent.append(i)
        if i == 2:
            done.set()

    q = SendQueue(lambda rid, e: None, gate=gate, gate_timeout_s=30.0).start()
    q.put("r0", lambda: send(0))
    time.sleep(0.3)
    assert sent == []  # the engine is not waiting on its device: nothing sent yet
    gate.set()
    q.put("r1", lambda: send(1))
    q.put("r2", lambda: send(2))
    assert done.wait(5.0) and sent == [0, 1, 2]
    q.close()

    gate.clear()
    late = threading.Event()
    q = SendQueue(lambda rid, e: None, gate=gate, gate_timeout_s=0.05).start()
    t0 = time.perf_counter()
    q.put("r3", late.set)
    assert late.wait(5.0)
    assert time.perf_counter() - t0 >= 0.04  # held for the timeout, then sent anyway
    q.close()


def test_send_queue_gate_never_throttles_a_backlog() -> None:
    """The gate is waited for once per batch of queued replies, not once per reply: with the gate never
    set and a 0.2 s timeout, 500 replies queued at once go out in about one timeout, not 500 of them."""
    gate = threading.Event()
    done = threading.Event()
    sent: list[int] = []

    def send(i: int) -> None:
        sent.append(i)
        if len(sent) == 500:
            done.set()

    q = SendQueue(lambda rid, e: None, gate=gate, gate_timeout_s=0.2)
    for i in range(500):
        q.put(f"r{i}", lambda i=i: send(i))
    t0 = time.perf_counter()
    q.start()
    assert done.wait(10.0), len(sent)
    assert time.perf_counter() - t0 < 3.0 and sent == list(range(500))
    q.close()


def test_serving_engine_device_wait_is_none_on_host_backends() -> None:
    eng = types.SimpleNamespace(runner=types.SimpleNamespace(backend=object()))
    from hybrid_runtime.serving import ServingEngine

    assert ServingEngine.device_wait.fget(eng) is None  # type: ignore[attr-defined]
    ev = threading.Event()
    eng.runner.backend = types.SimpleNamespace(device_wait=ev)
    assert ServingEngine.device_wait.fget(eng) is ev  # type: ignore[attr-defined]


# ---- metrics ------------------------------------------------------------------------------------------

class FakeMetric:
    def __init__(self, family: PlainFamily, labels: dict, buckets: list | None) -> None:
        self.family, self.labels, self.buckets, self.value, self.observed = family, labels, buckets, 0.0, []

    def set(self, v: float) -> None:
        self.value = v

    def increment(self, v: float) -> None:
        assert v > 0
        self.value += v

    def observe(self, v: float) -> None:
        self.observed.append(v)


class PlainFamily:
    """pb_utils.MetricFamily before histograms existed."""

    COUNTER, GAUGE = "counter", "gauge"

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.kind, self.metrics = name, kind, []
        REGISTRY[name] = self

    def Metric(self, labels: dict, buckets: list | None = None) -> FakeMetric:  # the pb_utils API's name
        assert (buckets is not None) == (self.kind == "histogram")
        m = FakeMetric(self, labels, buckets)
        self.metrics.append(m)
        return m


class FakeFamily(PlainFamily):
    HISTOGRAM = "histogram"


REGISTRY: dict[str, PlainFamily] = {}


def _value(name: str, **labels: str) -> float:
    for m in REGISTRY[name].metrics:
        if all(m.labels.get(k) == v for k, v in labels.items()):
            return m.value
    raise KeyError((name, labels))


def test_metrics_mirror_snapshot_deltas() -> None:
    snap = {"requests_running": 2, "slots_in_use": 2, "kv_pages_in_use": 5, "tokens_generated": 10,
            "finished": {"length": 1}, "attention_plans": {"single_block": 4}, "attention_fallbacks": {}}
    m = TritonMetrics(types.SimpleNamespace(MetricFamily=FakeFamily), lambda: snap, {"model": "m", "version": "1"})
    m.observe("ttft", 0.02)
    m.observe("itl", 0.005)
    m.count_rejected("invalid_argument")
    m.update()
    snap = {**snap, "slots_in_use": 0, "tokens_generated": 15, "finished": {"length": 1, "cancelled": 2}}
    m.update()
    assert _value("hybrid_llm_slots_in_use") == 0 and _value("hybrid_llm_kv_pages_in_use") == 5
    assert _value("hybrid_llm_generated_tokens_total") == 15
    assert _value("hybrid_llm_requests_finished_total", reason="cancelled") == 2
    assert _value("hybrid_llm_requests_finished_total", reason="length") == 1
    assert _value("hybrid_llm_attention_plans_total", kernel="single_block") == 4
    assert _value("hybrid_llm_requests_rejected_total", code="invalid_argument") == 1
    assert _value("hybrid_llm_time_to_first_token_seconds_bucket", le="0.01") == 0
    assert _value("hybrid_llm_time_to_first_token_seconds_bucket", le="0.025") == 1
    assert _value("hybrid_llm_time_to_first_token_seconds_bucket", le="+Inf") == 1
    assert _value("hybrid_llm_time_to_first_token_seconds_sum") == 0.02
    assert _value("hybrid_llm_inter_token_latency_seconds_bucket", le="0.005") == 1
    assert REGISTRY["hybrid_llm_slots_in_use"].metrics[0].labels == {"model": "m", "version": "1"}
    m.stop()


class CountingMetric(FakeMetric):
    calls = 0

    def set(self, v: float) -> None:
        CountingMetric.calls += 1
        super().set(v)

    def increment(self, v: float) -> None:
        CountingMetric.calls += 1
        super().increment(v)


class CountingFamily(PlainFamily):
    def Metric(self, labels: dict, buckets: list | None = None) -> FakeMetric:
        assert buckets is None  # latency histograms are counters in the histogram exposition format
        m = CountingMetric(self, labels, None)
        self.metrics.append(m)
        return m


def test_latency_histograms_are_cumulative_counters_pushed_once_per_update() -> None:
    """Each pb_utils metric call is a GIL-holding round trip to the server: 1000 token samples must not
    become 1000 calls, and an unchanged gauge is not set again."""
    snap = {"requests_running": 1, "slots_in_use": 1}
    m = TritonMetrics(types.SimpleNamespace(MetricFamily=CountingFamily), lambda: snap, {})
    m.update()
    CountingMetric.calls = 0
    m.update()
    assert CountingMetric.calls == 0  # nothing changed: no round trip at all
    for i in range(1000):
        m.observe("itl", 0.004 if i % 2 else 0.02)
    m.update()
    buckets = len(LATENCY_BUCKETS)
    assert CountingMetric.calls <= buckets + 2
    assert _value("hybrid_llm_inter_token_latency_seconds_count") == 1000
    assert _value("hybrid_llm_inter_token_latency_seconds_bucket", le="0.0025") == 0
    assert _value("hybrid_llm_inter_token_latency_seconds_bucket", le="0.005") == 500
    assert _value("hybrid_llm_inter_token_latency_seconds_bucket", le="0.025") == 1000
    assert _value("hybrid_llm_inter_token_latency_seconds_bucket", le="+Inf") == 1000
    assert abs(_value("hybrid_llm_inter_token_latency_seconds_sum") - 12.0) < 1e-9
    m.observe("itl", 0.5)
    CountingMetric.calls = 0
    m.update()
    assert CountingMetric.calls == 8  # only what changed: le = 0.5, 1, 2.5, 5, 10, +Inf; sum; count


# ---- model.py through a stubbed triton_python_backend_utils ------------------------------------------

class _TritonError(Exception):
    INTERNAL, INVALID_ARG, UNAVAILABLE, CANCELLED = "INTERNAL", "INVALID_ARG", "UNAVAILABLE", "CANCELLED"

    def __init__(self, message: str, code: str = "INTERNAL") -> None:
        super().__init__(message)
        self.code = code

    def message(self) -> str:
        return str(self.args[0])


class _Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self.array = name, array

    def as_numpy(self) -> np.ndarray:
        return self.array


class _Response:
    def __init__(self, output_tensors: list | None = None, error: _TritonError | None = None) -> None:
        self.outputs = {t.name: t.array for t in output_tensors or []}
        self.error = error


class _Sender:
    def __init__(self) -> None:
        self.responses: list[tuple[_Response, int]] = []
        self.done = threading.Event()

    def send(self, response: _Response, flags: int = 0) -> None:
        assert not self.done.is_set(), "response after the final one"
        self.responses.append((response, flags))
        if flags == 1:
            self.done.set()


class _Request:
    def __init__(self, **inputs: np.ndarray) -> None:
        self.inputs, self.sender, self.cancelled = inputs, _Sender(), False

    def get_response_sender(self) -> _Sender:
        return self.sender

    def is_cancelled(self) -> bool:
        return self.cancelled


def _fake_pb_utils() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb.TritonError = _TritonError
    pb.TritonModelException = RuntimeError
    pb.Tensor = _Tensor
    pb.InferenceResponse = _Response
    pb.InferenceRequest = _Request
    pb.MetricFamily = FakeFamily
    pb.get_input_tensor_by_name = lambda req, name: _Tensor(name, req.inputs[name]) if name in req.inputs else None
    pb.using_decoupled_model_transaction_policy = lambda cfg: cfg["model_transaction_policy"]["decoupled"]
    pb.is_model_ready = lambda name, version="": True
    return pb


@pytest.fixture
def model(default_bundle: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_pb_utils())
    spec = importlib.util.spec_from_file_location("hybrid_llm_model_under_test", MODEL_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = {"model_transaction_policy": {"decoupled": True},
           "parameters": {"engine_dir": {"string_value": str(default_bundle)},
                          "default_max_tokens": {"string_value": "5"}, "log_level": {"string_value": "warning"}}}
    m = module.TritonPythonModel()
    m.initialize({"model_config": json.dumps(cfg), "model_repository": str(MODEL_PY.parents[1]),
                  "model_name": "hybrid_llm", "model_version": "1", "model_instance_name": "hybrid_llm_0"})
    yield m
    m.finalize()


def test_model_py_streams_rejects_and_cancels(model) -> None:
    streamed = _Request(text_input=_bytes(b"The quick brown fox"), stream=np.array([True]),
                        sampling_parameters=_bytes(b'{"ignore_eos": true}'))
    whole = _Request(text_input=_bytes(b"The quick brown fox"), sampling_parameters=_bytes(b'{"ignore_eos": true}'))
    bad = _Request(text_input=_bytes(b"x"), sampling_parameters=_bytes(b'{"max_tokens": -3}'))
    endless = _Request(input_ids=np.array([5, 6, 7], dtype=np.int32), stream=np.array([True]),
                       sampling_parameters=_bytes(b'{"ignore_eos": true, "max_tokens": 400}'))
    assert model.execute([streamed, whole, bad, endless]) is None
    for req in (streamed, whole, bad):
        assert req.sender.done.wait(60)
    (err, flags), = bad.sender.responses
    assert flags == 1 and err.error.code == "INVALID_ARG" and "max_tokens" in err.error.message()
    assert err.error.message().startswith("[INVALID_ARG] ")  # gRPC streams carry the text, not the code

    tokens = [r.outputs for r, f in streamed.sender.responses if f == 0]
    final = streamed.sender.responses[-1][0].outputs
    assert len(tokens) == 4 and len(final["output_ids"]) == 1  # the 5th token rides on the final response
    assert final["finish_reason"][0] == b"length"
    ids = [int(i) for t in tokens for i in t["output_ids"]] + final["output_ids"].tolist()
    (one, flags), = whole.sender.responses
    assert flags == 1 and one.outputs["output_ids"].tolist() == ids
    text = "".join(t["text_output"][0].decode() for t in tokens) + final["text_output"][0].decode()
    assert one.outputs["text_output"][0].decode() == "The quick brown fox" + text

    endless.cancelled = True  # the watcher notices within ~50 ms and cancels it in the engine
    assert endless.sender.done.wait(30)
    assert endless.sender.responses[-1][0].outputs["finish_reason"][0] == b"cancelled"


def test_model_py_drains_its_streams_on_sigterm(model) -> None:
    """SIGTERM to the stub process (deploy.triton.TritonServer.stop sends it before the server's): the stream in
    flight gets its final "cancelled" response, and the model never asks Triton for its readiness again."""
    import triton_python_backend_utils as pb

    asked: list[bool] = []
    pb.is_model_ready = lambda name, version="": asked.append(True) or True
    endless = _Request(input_ids=np.array([5, 6, 7], dtype=np.int32), stream=np.array([True]),
                       sampling_parameters=_bytes(b'{"ignore_eos": true, "max_tokens": 400}'))
    model.execute([endless])
    deadline = time.monotonic() + 30
    while not endless.sender.responses and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)  # the model's handler records it; the test process carries on
    assert endless.sender.done.wait(30)
    final = endless.sender.responses[-1][0].outputs
    assert final["finish_reason"][0] == b"cancelled"
    assert len(endless.sender.responses) < 400
    n = len(asked)
    late = _Request(input_ids=np.array([5, 6], dtype=np.int32), stream=np.array([True]),
                    sampling_parameters=_bytes(b'{"ignore_eos": true, "max_tokens": 400}'))
    model.execute([late])  # arriving during the shutdown: cancelled too
    assert late.sender.done.wait(30)
    assert late.sender.responses[-1][0].outputs["finish_reason"][0] == b"cancelled"
    assert len(asked) == n


def test_model_py_sends_logprobs_and_prompt_length(model) -> None:
    req = _Request(text_input=_bytes("The quick brown fox 🙂".encode()), stream=np.array([True]),
                   sampling_parameters=_bytes(b'{"ignore_eos": true, "max_tokens": 6, "logprobs": 2}'))
    model.execute([req])
    assert req.sender.done.wait(60)
    outs = [r.outputs for r, _ in req.sender.responses]
    docs = [d for o in outs for d in json.loads(o["output_logprobs"][0])]
    ids = [int(i) for o in outs for i in o["output_ids"]]
    assert [d["token_id"] for d in docs] == ids and len(ids) == 6
    tok = model.engine.tokenizer
    for d in docs:
        assert bytes(d["bytes"]) == tok.token_bytes(d["token_id"]) and len(d["top_logprobs"]) == 2
        assert d["top_logprobs"][0]["logprob"] >= d["top_logprobs"][1]["logprob"]
        assert d["top_logprobs"][0]["token_id"] == d["token_id"]  # greedy
    assert outs[-1]["num_input_tokens"].tolist() == [len(tok.encode("The quick brown fox 🙂"))]


def test_heap_gauges_carry_the_stub_pid_and_only_with_heap_debugging() -> None:
    import os

    REGISTRY.clear()
    TritonMetrics(types.SimpleNamespace(MetricFamily=FakeFamily), dict, {"model": "m"}).update()
    assert "hybrid_llm_python_heap_bytes" not in REGISTRY
    heap = {"python_heap_bytes": 5e6, "python_heap_peak_bytes": 6e6, "tracemalloc_overhead_bytes": 1e6, "other": 1}
    TritonMetrics(types.SimpleNamespace(MetricFamily=FakeFamily), dict, {"model": "m"}, heap=lambda: heap).update()
    assert _value("hybrid_llm_python_heap_bytes", pid=str(os.getpid()), model="m") == 5e6
    assert _value("hybrid_llm_tracemalloc_overhead_bytes", pid=str(os.getpid())) == 1e6
    assert "hybrid_llm_other" not in REGISTRY
