"""The valid-traffic locust users: gRPC streaming and HTTP ``generate_stream`` (server-sent events).

Each task draws a request (prompt of 1..max_input_len tokens, mixed max_tokens, greedy or sampled),
streams it, records time to first token and every inter-token gap as locust custom metrics
(``events.request`` with request_type "TTFT" / "ITL", name = transport), checks the response
(:func:`loadtests.common.check_result`, plus greedy reproducibility) and reports the whole request as one
locust request: a failure for any problem. Import this only in a locust process, after
``grpc.experimental.gevent.init_gevent()`` (the locustfile does both).
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from locust import HttpUser, User, between, task

from .common import (
    BundleInfo,
    GrpcStream,
    PromptPool,
    Reply,
    SoakStats,
    StreamTimeout,
    Target,
    _squash,
    check_result,
    grpc_inputs,
    make_spec,
    reply_from_sse,
    sse_payload,
)

GENERATE_STREAM = "/v2/models/hybrid_llm/generate_stream"


@dataclass
class Context:
    """What every user of this locust process shares (built once, on the first user's start)."""

    target: Target
    bundle: BundleInfo
    pool: PromptPool
    stats: SoakStats
    timeout_s: float
    seed: int


_ctx: Context | None = None
_ctx_lock = threading.Lock()
STATS = SoakStats()


def context(host: str | None) -> Context:
    """Addresses from ``--host`` (HTTP) and ``SOAK_GRPC_URL`` / ``SOAK_METRICS_URL``; the bundle from the server."""
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            http = host or os.environ.get("SOAK_HTTP_URL") or "127.0.0.1:8000"
            target = Target.from_url(http, os.environ.get("SOAK_GRPC_URL") or None,
                                     os.environ.get("SOAK_METRICS_URL") or None)
            bundle = BundleInfo.from_server(target.http)
            seed = int(os.environ.get("SOAK_SEED", "0"))
            _ctx = Context(target, bundle, PromptPool(bundle, seed=seed), STATS,
                           float(os.environ.get("SOAK_REQUEST_TIMEOUT", "180")), seed)
        return _ctx


_user_ids = iter(range(1, 1 << 30))


def user_rng(ctx: Context) -> random.Random:
    return random.Random(ctx.seed * 1_000_003 + next(_user_ids))


def fire(user: User, request_type: str, name: str, seconds: float, length: int = 0,
         exception: Exception | None = None) -> None:
    user.environment.events.request.fire(request_type=request_type, name=name, response_time=seconds * 1000.0,
                                         response_length=length, exception=exception, context={})


class Collected:
    """One streamed request's replies: ids, text, reply times, finish reason or error."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.ids: list[int] = []
        self.text: list[str] = []
        self.times: list[float] = []
        self.finish_reason: str | None = None
        self.final = False
        self.error: str | None = None

    def take(self, r: Reply) -> None:
        if r.error is not None:
            self.error, self.final = r.error, True
            return
        if r.ids:
            self.ids.extend(r.ids)
            self.times.append(r.t)
        self.text.append(r.text)
        if r.final:
            self.final, self.finish_reason = True, r.finish_reason

    def finish(self, user: User, ctx: Context, transport: str, spec: Any) -> list[str]:
        """Record latencies, check the response, return the problems (empty: success)."""
        e2e = time.perf_counter() - self.t0
        if self.error is not None:
            problems = [f"error: {self.error}"]
        elif not self.final:
            problems = ["stream ended without a final response"]
        else:
            problems = check_result(spec, self.ids, "".join(self.text), self.finish_reason)
            if not problems and spec.greedy:
                with ctx.stats.lock:
                    mismatch = ctx.stats.greedy.check(spec.greedy_key, self.ids)
                if mismatch:
                    problems.append(mismatch)
        ttft = self.times[0] - self.t0 if self.times else None
        itls = [b - a for a, b in zip(self.times, self.times[1:])]
        if ttft is not None:
            fire(user, "TTFT", transport, ttft)
        for gap in itls:
            fire(user, "ITL", transport, gap)
        ctx.stats.record_tokens(transport, ttft, itls, e2e, len(self.ids))
        ctx.stats.record_valid(transport, not problems, problems)
        return problems


class GrpcStreamUser(User):
    """tritonclient.grpc: one client and one bidirectional stream per user, closed in on_stop."""

    wait_time = between(0.05, 0.5)

    def on_start(self) -> None:
        self.ctx = context(self.host)
        self.rng = user_rng(self.ctx)
        self.stream = GrpcStream(self.ctx.target.grpc)

    def on_stop(self) -> None:
        self.stream.close()  # cancels only a request still in flight (the run stopped in the middle of it)

    @task
    def generate(self) -> None:
        from tritonclient.utils import InferenceServerException

        spec = make_spec(self.ctx.pool, self.rng)
        got = Collected()
        try:
            for reply in self.stream.generate(grpc_inputs(spec.request_dict()), timeout=self.ctx.timeout_s):
                got.take(reply)
        except StreamTimeout as e:
            got.error = str(e)
        except InferenceServerException as e:  # the stream itself broke (server gone?)
            got.error = f"gRPC: {e.message()}"
            self.stream.reset()
        problems = got.finish(self, self.ctx, "grpc", spec)
        fire(self, "gRPC", "generate_stream", time.perf_counter() - got.t0, len(got.ids),
             RuntimeError(_squash("; ".join(problems))) if problems else None)


class HttpStreamUser(HttpUser):
    """Triton's HTTP generate extension: POST generate_stream, read server-sent events as they arrive."""

    wait_time = between(0.05, 0.5)

    def on_start(self) -> None:
        self.ctx = context(self.host)
        self.rng = user_rng(self.ctx)

    @task
    def generate(self) -> None:
        import requests

        spec = make_spec(self.ctx.pool, self.rng)
        got = Collected()
        with self.client.post(GENERATE_STREAM, json=spec.request_dict(), stream=True, catch_response=True,
                              name="generate_stream", timeout=(10.0, self.ctx.timeout_s)) as resp:
            try:
                if resp.status_code != 200:
                    got.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                else:
                    for line in resp.iter_lines():
                        obj = sse_payload(line)
                        if obj is not None:
                            got.take(reply_from_sse(obj, time.perf_counter()))
                        if got.final:
                            break
            except (requests.RequestException, ValueError) as e:
                got.error = f"{type(e).__name__}: {e}"
            problems = got.finish(self, self.ctx, "http", spec)
            # the row shows the whole streamed request, not only the time to the response headers
            resp.request_meta["response_time"] = (time.perf_counter() - got.t0) * 1000.0
            resp.request_meta["response_length"] = len(got.ids)
            if problems:
                resp.failure(_squash("; ".join(problems)))
            else:
                resp.success()
