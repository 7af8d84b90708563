"""The fault locust user: invalid requests, cancelled streams and clients that disconnect mid-stream.

Every fault has an expected outcome, and each attempt is counted by kind as ``expected``,
``unexpected_success`` or ``wrong_error`` (in the summary and as locust request_type "FAULT" rows; only
the last two are locust failures):

* invalid inputs (gRPC and HTTP): the request must end with an error whose message matches the kind's
  pattern (e.g. ``max_input_len`` for a prompt over the limit), and carry no token;
* ``cancel_mid_stream`` (gRPC): a valid request (ignore_eos, room for many tokens) is cancelled with
  ``stop_stream(cancel_requests=True)`` after 0..8 tokens; before that it must stream without error;
* ``cancel_after_final`` (gRPC, on unless FAULT_CANCEL_AFTER_FINAL=0): a short valid request runs to its
  final response, then the stream is closed with ``stop_stream(cancel_requests=True)`` at once;
* ``disconnect_mid_stream`` (HTTP): the socket is closed after 0..8 server-sent events; before that the
  events must be tokens, not errors.

``SOAK_PROTOCOL=grpc`` (or ``http``) keeps only the faults of that transport; ``FAULT_FILTER`` (a regex on
the names) narrows them further.

A gRPC stream that carried an error (a request the core or the model refused) is closed without a cancel
and a new one opened, as this project's clients do (a stream per request). ``FAULT_REUSE_STREAM_AFTER_ERROR=1``
keeps it open for the next fault instead: a ``cancel_mid_stream`` on such a stream trips a Triton 2.51 gRPC
frontend leak (~11 KB per stream, and the model never unloads at shutdown: deploy/README.md), which a client
that reuses a stream after an error would meet.

The server must survive all of this: the valid users' failures, readiness and the drain of slots and KV
pages afterwards are the soak runner's checks.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from locust import User, between, task

from .common import GrpcStream, StreamTimeout, grpc_input, grpc_inputs, protocols, reply_from_sse, sse_payload
from .users import Context, context, fire, user_rng

MAX_CANCEL_AFTER = 8


@dataclass(frozen=True)
class InvalidCase:
    """An invalid request: ``make`` builds it (gRPC inputs or an HTTP body); ``expect`` must match the error."""

    kind: str
    transport: str  # "grpc" | "http"
    make: Callable[[Context, random.Random], Any]
    expect: str

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.transport}"


def _g(ctx: Context, rng: random.Random, text: Any = "Hello there", **extra: Any) -> list:
    """gRPC inputs: a streamed request with ``text`` (None: no text_input) plus ``extra`` inputs."""
    inputs = [grpc_input("stream", True)]
    if text is not None:
        inputs.append(grpc_input("text_input", text))
    for name, value in extra.items():
        inputs.append(value if not isinstance(value, int | str | bytes | bool | list) else grpc_input(name, value))
    return inputs


def _sampling(obj: Any) -> Any:
    return obj if isinstance(obj, str | bytes) else json.dumps(obj)


OUT_OF_RANGE = [{"temperature": -1}, {"temperature": 1000}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -5},
                {"seed": -1}, {"max_tokens": 4, "min_tokens": 99}, {"max_tokens": 0}, {"stop": [""]},
                {"n": 2}, {"frobnicate": 1}, {"temperature": "hot"}, {"ignore_eos": "maybe"},
                {"temperature": float("nan")}]
MALFORMED = ["{bad", "[1, 2]", '"a string"', '{"temperature": }', "null", "{'single': 'quotes'}"]
NON_UTF8 = [b"\xff\xfe", b"abc\x80def", b"\xc3\x28 hello", b"\xed\xa0\x80"]


def _grpc_cases() -> list[InvalidCase]:
    def wrong_dtype(ctx: Context, rng: random.Random) -> list:
        return rng.choice([
            lambda: _g(ctx, rng, max_tokens=grpc_input("max_tokens", 4.0, "FP32")),
            lambda: [grpc_input("text_input", "hi"), grpc_input("stream", 1, "INT32")],
            lambda: [grpc_input("stream", True), grpc_input("text_input", 7, "INT32")],
            lambda: _g(ctx, rng, None, input_ids=grpc_input("input_ids", [1, 2, 3], "INT64")),
        ])()

    def wrong_shape(ctx: Context, rng: random.Random) -> list:
        return rng.choice([
            lambda: _g(ctx, rng, None, text_input=grpc_input("text_input", ["hi", "there"])),
            lambda: _g(ctx, rng, None, input_ids=grpc_input("input_ids", [1, 2, 3, 4], shape=[2, 2])),
            lambda: [grpc_input("text_input", "hi"), grpc_input("stream", [True, True, True])],
            lambda: _g(ctx, rng, max_tokens=grpc_input("max_tokens", [4, 4])),
        ])()

    def huge_max_tokens(ctx: Context, rng: random.Random) -> list:
        return rng.choice([
            lambda: _g(ctx, rng, max_tokens=2**31 - 1),
            lambda: _g(ctx, rng, sampling_parameters=_sampling({"max_tokens": 10**9})),
            lambda: _g(ctx, rng, max_tokens=ctx.bundle.max_seq_len),
            lambda: _g(ctx, rng, max_tokens=-5),
            lambda: _g(ctx, rng, max_tokens=8, sampling_parameters=_sampling({"max_tokens": 9})),
        ])()

    def ids_out_of_range(ctx: Context, rng: random.Random) -> list:
        ids = rng.choice([[ctx.bundle.vocab_size], [1, 2, -1], [10**6, 3]])
        return _g(ctx, rng, None, input_ids=ids)

    return [
        InvalidCase("empty_prompt", "grpc", lambda c, r: _g(c, r, ""), r"empty"),
        InvalidCase("prompt_over_max_input_len", "grpc", lambda c, r: _g(c, r, c.pool.over_limit.text),
                    r"max_input_len"),
        InvalidCase("malformed_sampling_json", "grpc",
                    lambda c, r: _g(c, r, sampling_parameters=r.choice(MALFORMED)), r"JSON"),
        InvalidCase("out_of_range_sampling", "grpc",
                    lambda c, r: _g(c, r, sampling_parameters=_sampling(r.choice(OUT_OF_RANGE))),
                    r"sampling parameter"),
        InvalidCase("non_utf8", "grpc", lambda c, r: r.choice([
            lambda: _g(c, r, r.choice(NON_UTF8)),
            lambda: _g(c, r, sampling_parameters=b'{"temperature": "\xff"}')])(), r"UTF-8"),
        InvalidCase("wrong_dtype", "grpc", wrong_dtype, r"data-?type"),
        InvalidCase("wrong_shape", "grpc", wrong_shape, r"shape"),
        InvalidCase("missing_inputs", "grpc", lambda c, r: r.choice([
            lambda: _g(c, r, None),
            lambda: _g(c, r, "hi", input_ids=[1, 2, 3])])(), r"exactly one"),
        InvalidCase("unknown_input", "grpc", lambda c, r: _g(c, r, bogus=grpc_input("bogus", 1, "INT32")),
                    r"unexpected inference input"),
        InvalidCase("huge_max_tokens", "grpc", huge_max_tokens, r"max_tokens|max_seq_len"),
        InvalidCase("input_ids_out_of_range", "grpc", ids_out_of_range, r"input_ids"),
        InvalidCase("exclude_input_false_while_streaming", "grpc",
                    lambda c, r: _g(c, r, exclude_input_in_output=False), r"exclude_input_in_output"),
    ]


def _body(**fields: Any) -> bytes:
    return json.dumps({"stream": True, **fields}).encode()


def _http_cases() -> list[InvalidCase]:
    return [
        InvalidCase("empty_prompt", "http", lambda c, r: _body(text_input=""), r"empty"),
        InvalidCase("prompt_over_max_input_len", "http", lambda c, r: _body(text_input=c.pool.over_limit.text),
                    r"max_input_len"),
        InvalidCase("malformed_sampling_json", "http",
                    lambda c, r: _body(text_input="hi", sampling_parameters=r.choice(MALFORMED)), r"JSON"),
        InvalidCase("out_of_range_sampling", "http",
                    lambda c, r: _body(text_input="hi", sampling_parameters=_sampling(r.choice(OUT_OF_RANGE))),
                    r"sampling parameter"),
        InvalidCase("non_utf8", "http", lambda c, r: b'{"stream": true, "text_input": "' + r.choice(NON_UTF8) + b'"}',
                    r"UTF-8"),
        InvalidCase("wrong_dtype", "http", lambda c, r: _body(text_input="hi", max_tokens=r.choice([1.5, "lots"])),
                    r"parse|data-?type"),
        InvalidCase("missing_inputs", "http", lambda c, r: _body(), r"exactly one"),
        InvalidCase("huge_max_tokens", "http", lambda c, r: _body(text_input="hi", max_tokens=2**31 - 1),
                    r"max_tokens|max_seq_len"),
        InvalidCase("malformed_body", "http", lambda c, r: r.choice([b"{not json", b"[]", b""]),
                    r"pars|JSON|json|object|empty|invalid"),
    ]


GRPC_CASES = _grpc_cases()
HTTP_CASES = _http_cases()
FAULT_NAMES = ([c.name for c in GRPC_CASES] + [c.name for c in HTTP_CASES]
               + ["cancel_mid_stream/grpc", "cancel_after_final/grpc", "disconnect_mid_stream/http"])


def fault_wanted(name: str, transports: tuple[str, ...], pattern: re.Pattern[str]) -> bool:
    """Whether the fault ``name`` ("<kind>/<transport>") runs: its transport is driven and FAULT_FILTER matches."""
    return name.rsplit("/", 1)[-1] in transports and bool(pattern.search(name))


class FaultUser(User):
    """Sends faults; a configurable share of the users (FAULT_SHARE, set as this class's weight)."""

    wait_time = between(0.1, 0.5)

    def on_start(self) -> None:
        self.ctx = context(self.host)
        self.rng = user_rng(self.ctx)
        self.stream = GrpcStream(self.ctx.target.grpc)
        self.reuse_after_error = os.environ.get("FAULT_REUSE_STREAM_AFTER_ERROR", "0") == "1"
        # cancel_after_final is on unless FAULT_CANCEL_AFTER_FINAL=0. It can trip a Triton 2.51 gRPC-frontend
        # bug (a model reference is left behind, so the server cannot unload at shutdown: deploy/README.md);
        # the soak recognises that exact shape and still checks that the model itself stays sound.
        after_final = 0.05 if os.environ.get("FAULT_CANCEL_AFTER_FINAL", "1") != "0" else 0.0
        kinds = [(self.invalid_grpc, 0.45), (self.invalid_http, 0.25), (self.cancel_mid_stream, 0.12),
                 (self.cancel_after_final, after_final), (self.disconnect_mid_stream, 0.13)]
        # FAULT_FILTER (a regex on fault names such as "wrong_dtype/grpc" or "cancel_mid_stream/grpc")
        # narrows the faults down, e.g. to find which one upsets the server.
        # SOAK_PROTOCOL (grpc | http) keeps only the faults of that transport.
        pattern = re.compile(os.environ.get("FAULT_FILTER") or ".")
        transports = protocols()

        def wanted(name: str) -> bool:
            return fault_wanted(name, transports, pattern)

        self.grpc_cases = [c for c in GRPC_CASES if wanted(c.name)]
        self.http_cases = [c for c in HTTP_CASES if wanted(c.name)]
        keep = {self.invalid_grpc: bool(self.grpc_cases), self.invalid_http: bool(self.http_cases),
                self.cancel_mid_stream: wanted("cancel_mid_stream/grpc"),
                self.cancel_after_final: wanted("cancel_after_final/grpc"),
                self.disconnect_mid_stream: wanted("disconnect_mid_stream/http")}
        self.kinds: list[tuple[Callable[[], None], float]] = [(k, w) for k, w in kinds if keep[k] and w > 0]
        if not self.kinds:
            raise ValueError(f"FAULT_FILTER={pattern.pattern!r} with SOAK_PROTOCOL={'+'.join(transports)} "
                             f"matches no fault")

    def on_stop(self) -> None:
        self.stream.close()

    @task
    def fault(self) -> None:
        action = self.rng.choices([k for k, _ in self.kinds], weights=[w for _, w in self.kinds], k=1)[0]
        action()

    # ---- bookkeeping --------------------------------------------------------------------------------
    def _outcome(self, kind: str, outcome: str, t0: float, detail: str = "") -> None:
        self.ctx.stats.record_fault(kind, outcome, detail)
        exc = None if outcome == "expected" else RuntimeError(f"{outcome}: {re.sub(r'[0-9]+', 'N', detail)[:160]}")
        fire(self, "FAULT", kind, time.perf_counter() - t0, 0, exc)

    def _judge_error(self, case: InvalidCase, t0: float, error: str | None, tokens: int) -> None:
        if error is None:
            self._outcome(case.name, "unexpected_success", t0, f"no error ({tokens} tokens)")
        elif tokens:
            self._outcome(case.name, "wrong_error", t0, f"{tokens} tokens before the error: {error}")
        elif re.search(case.expect, error, re.IGNORECASE):
            self._outcome(case.name, "expected", t0)
        else:
            self._outcome(case.name, "wrong_error", t0, f"expected /{case.expect}/, got: {error}")

    # ---- invalid inputs ----------------------------------------------------------------------------
    def invalid_grpc(self) -> None:
        from tritonclient.utils import InferenceServerException

        case = self.rng.choice(self.grpc_cases)
        t0 = time.perf_counter()
        error, tokens = None, 0
        try:
            for reply in self.stream.generate(case.make(self.ctx, self.rng), timeout=self.ctx.timeout_s):
                if reply.error is not None:
                    error = reply.error
                tokens += len(reply.ids)
        except StreamTimeout as e:
            self._outcome(case.name, "wrong_error", t0, str(e))
            return
        except InferenceServerException as e:  # refused on the client side or the stream broke
            error = e.message()
            self.stream.reset()
        if error is not None and not self.reuse_after_error:
            self.stream.reset(cancel=False)  # a stream that carried an error is closed, not reused
        self._judge_error(case, t0, error, tokens)

    def invalid_http(self) -> None:
        case = self.rng.choice(self.http_cases)
        t0 = time.perf_counter()
        host, _, port = self.ctx.target.http.partition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=self.ctx.timeout_s)
        error, tokens = None, 0
        try:
            conn.request("POST", "/v2/models/hybrid_llm/generate_stream", body=case.make(self.ctx, self.rng),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            for line in resp.read().splitlines():
                obj = sse_payload(line) if line.startswith(b"data:") else _json_or_none(line)
                if obj is None:
                    continue
                reply = reply_from_sse(obj, time.perf_counter())
                error = reply.error if reply.error is not None else error
                tokens += len(reply.ids)
            if resp.status != 200 and error is None:
                error = f"HTTP {resp.status}"
        except (OSError, http.client.HTTPException, ValueError) as e:
            self._outcome(case.name, "wrong_error", t0, f"{type(e).__name__}: {e}")
            return
        finally:
            conn.close()
        self._judge_error(case, t0, error, tokens)

    # ---- cancellation and disconnects --------------------------------------------------------------
    def _long_request(self) -> tuple[dict[str, Any], int]:
        prompt = self.ctx.pool.pick(self.rng)
        room = self.ctx.bundle.max_seq_len - prompt.tokens
        return ({"text_input": prompt.text, "stream": True, "max_tokens": max(1, min(room, 256)),
                 "sampling_parameters": json.dumps({"ignore_eos": True, "temperature": 0.8})},
                self.rng.randint(0, MAX_CANCEL_AFTER))

    def cancel_mid_stream(self) -> None:
        from tritonclient.utils import InferenceServerException

        kind = "cancel_mid_stream/grpc"
        request, after = self._long_request()
        t0 = time.perf_counter()
        tokens, outcome, detail = 0, "expected", ""
        try:
            if after:
                for reply in self.stream.generate(grpc_inputs(request), timeout=self.ctx.timeout_s):
                    if reply.error is not None:
                        outcome, detail = "wrong_error", f"error before the cancel: {reply.error}"
                        break
                    tokens += len(reply.ids)
                    if reply.final:
                        outcome, detail = "unexpected_success", f"finished after {tokens} tokens, before the cancel"
                        break
                    if tokens >= after:
                        break
            else:  # cancel while it is queued or prefilling, before any token can arrive
                self.stream.send(grpc_inputs(request))
        except StreamTimeout as e:
            outcome, detail = "wrong_error", str(e)
        except InferenceServerException as e:
            outcome, detail = "wrong_error", e.message()
        finally:
            self.stream.reset()  # cancels only while the request is in flight (never a finished stream)
        self._outcome(kind, outcome, t0, detail)

    def cancel_after_final(self) -> None:
        from tritonclient.utils import InferenceServerException

        kind = "cancel_after_final/grpc"
        request = {"text_input": self.ctx.pool.pick(self.rng).text[:200] or "Hello", "stream": True,
                   "max_tokens": self.rng.randint(1, 8)}
        t0 = time.perf_counter()
        outcome, detail, final = "expected", "", False
        try:
            for reply in self.stream.generate(grpc_inputs(request), timeout=self.ctx.timeout_s):
                if reply.error is not None:
                    outcome, detail = "wrong_error", f"error before the final response: {reply.error}"
                final = final or reply.final
            if outcome == "expected" and not final:
                outcome, detail = "wrong_error", "no final response"
        except StreamTimeout as e:
            outcome, detail = "wrong_error", str(e)
        except InferenceServerException as e:
            outcome, detail = "wrong_error", e.message()
        finally:
            self.stream.reset(cancel=True)  # the fault: cancel a stream whose request has finished
        self._outcome(kind, outcome, t0, detail)

    def disconnect_mid_stream(self) -> None:
        kind = "disconnect_mid_stream/http"
        request, after = self._long_request()
        t0 = time.perf_counter()
        host, _, port = self.ctx.target.http.partition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=self.ctx.timeout_s)
        outcome, detail, events = "expected", "", 0
        try:
            conn.request("POST", "/v2/models/hybrid_llm/generate_stream", body=json.dumps(request).encode(),
                         headers={"Content-Type": "application/json"})
            if after:
                resp = conn.getresponse()
                if resp.status != 200:
                    outcome, detail = "wrong_error", f"HTTP {resp.status}: {resp.read()[:200]!r}"
                while outcome == "expected" and events < after:
                    line = resp.fp.readline()
                    if not line:
                        outcome, detail = "unexpected_success", f"stream ended after {events} events"
                        break
                    obj = sse_payload(line)
                    if obj is None:
                        continue
                    reply = reply_from_sse(obj, time.perf_counter())
                    if reply.error is not None:
                        outcome, detail = "wrong_error", f"error before the disconnect: {reply.error}"
                    elif reply.final:
                        outcome, detail = "unexpected_success", f"finished after {events} events"
                    events += 1
        except (OSError, http.client.HTTPException, ValueError) as e:
            outcome, detail = "wrong_error", f"{type(e).__name__}: {e}"
        finally:
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            conn.close()
        self._outcome(kind, outcome, t0, detail)


def _json_or_none(line: bytes) -> dict[str, Any] | None:
    line = line.strip()
    if not line.startswith(b"{"):
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None
