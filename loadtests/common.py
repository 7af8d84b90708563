"""Pieces shared by the locust users and the soak runner (no gevent, no locust imports here).

* :class:`Target` — the server's HTTP, gRPC and metrics addresses.
* :class:`BundleInfo` — the limits of the served bundle (``max_input_len`` ...) from its manifest; the
  bundle directory comes from the server's own model config (``engine_dir``).
* :class:`PromptPool` — prompts of known token counts, short to exactly ``max_input_len``, cut from the
  builder's corpus with the bundle's own tokenizer; :func:`make_spec` draws a valid request from it.
* :func:`check_result` — what every valid response must satisfy.
* :class:`GrpcStream` — one tritonclient gRPC stream, one request at a time, as an iterator of replies.
* :class:`LogHistogram`, :class:`SoakStats` — exact-enough percentiles (1 % buckets) and the counters the
  locust process writes to its summary JSON for the runner's verdict.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import random
import re
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MODEL = "hybrid_llm"
CORPUS = REPO / "builder" / "data" / "corpus.txt"
DEFAULT_ENGINE = REPO / "engines" / "default"
FINISH_REASONS = ("length", "stop")


# ---- addresses --------------------------------------------------------------------------------------

def _hostport(url: str) -> tuple[str, int]:
    url = url.strip().removeprefix("http://").removeprefix("https://").rstrip("/")
    host, _, port = url.partition(":")
    if not port.isdigit():
        raise ValueError(f"{url!r}: expected host:port")
    return host or "127.0.0.1", int(port)


@dataclass(frozen=True, slots=True)
class Target:
    """Where the server answers: ``http`` and ``grpc`` as host:port, ``metrics`` as a full URL."""

    http: str
    grpc: str
    metrics: str

    @classmethod
    def from_url(cls, url: str, grpc: str | None = None, metrics: str | None = None) -> Target:
        """``url`` is the HTTP host:port; gRPC and metrics default to its port + 1 and + 2 (Triton's 8000/1/2)."""
        host, port = _hostport(url)
        grpc = grpc or f"{host}:{port + 1}"
        metrics = metrics or f"http://{host}:{port + 2}/metrics"
        if not metrics.startswith("http"):
            metrics = f"http://{metrics}"
        if not metrics.rstrip("/").endswith("/metrics"):
            metrics = metrics.rstrip("/") + "/metrics"
        return cls(f"{host}:{port}", grpc.removeprefix("http://"), metrics)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """Status and body of a GET (status 0 when nothing answers)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, urllib.error.URLError):
        return 0, b""


def model_config(http: str, model: str = MODEL, timeout: float = 10.0) -> dict[str, Any]:
    status, body = http_get(f"http://{http}/v2/models/{model}/config", timeout)
    if status != 200:
        raise RuntimeError(f"GET /v2/models/{model}/config on {http} answered {status}: {body[:200]!r}")
    return json.loads(body)


def model_parameters(config: dict[str, Any]) -> dict[str, str]:
    return {k: v.get("string_value", v.get("stringValue", "")) for k, v in (config.get("parameters") or {}).items()}


# ---- the served bundle ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class BundleInfo:
    engine_dir: Path
    max_input_len: int
    max_seq_len: int
    max_batch_size: int
    vocab_size: int

    @property
    def tokenizer_file(self) -> Path:
        return self.engine_dir / "tokenizer.json"

    @classmethod
    def load(cls, engine_dir: str | Path) -> BundleInfo:
        engine_dir = Path(engine_dir)
        manifest = json.loads((engine_dir / "manifest.json").read_text())
        lim = manifest["limits"]
        return cls(engine_dir, int(lim["max_input_len"]), int(lim["max_seq_len"]), int(lim["max_batch_size"]),
                   int(manifest["model"]["vocab_size"]))

    @classmethod
    def from_server(cls, http: str, fallback: Path | None = None) -> BundleInfo:
        """The bundle the server reports in its model config (``engine_dir``), read from this machine.

        ``SOAK_ENGINE_DIR`` overrides it (a server on another filesystem); ``fallback`` is used when the
        reported directory is not readable here. ``SOAK_MAX_INPUT_LEN`` overrides the manifest's limit.
        """
        candidates = [os.environ.get("SOAK_ENGINE_DIR", "").strip()]
        with contextlib.suppress(RuntimeError, ValueError):
            candidates.append(model_parameters(model_config(http)).get("engine_dir", ""))
        candidates.append(str(fallback or DEFAULT_ENGINE))
        for c in candidates:
            if c and (Path(c) / "manifest.json").is_file():
                info = cls.load(c)
                override = os.environ.get("SOAK_MAX_INPUT_LEN", "").strip()
                if override:
                    info = cls(info.engine_dir, int(override), info.max_seq_len, info.max_batch_size, info.vocab_size)
                return info
        raise RuntimeError(f"no readable bundle manifest among {[c for c in candidates if c]}; set SOAK_ENGINE_DIR")


# ---- transports -----------------------------------------------------------------------------------------

PROTOCOLS = {"both": ("grpc", "http"), "grpc": ("grpc",), "http": ("http",)}


def protocols(value: str | None = None) -> tuple[str, ...]:
    """The transports a soak drives (``SOAK_PROTOCOL``: both, the default | grpc | http): the valid users'
    and the faults' (a fault's transport is the suffix of its name, e.g. ``cancel_mid_stream/grpc``)."""
    value = (os.environ.get("SOAK_PROTOCOL", "both") if value is None else value).strip().lower() or "both"
    if value not in PROTOCOLS:
        raise SystemExit(f"SOAK_PROTOCOL={value!r}: choose one of {', '.join(PROTOCOLS)}")
    return PROTOCOLS[value]


# ---- prompts and request specs --------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Prompt:
    index: int
    text: str
    tokens: int


class PromptPool:
    """Prompts with token counts spread from 1 to ``max_input_len`` (the last ones exactly at the limit)."""

    def __init__(self, bundle: BundleInfo, seed: int = 0, size: int = 48) -> None:
        import tokenizers

        self.bundle = bundle
        self.tok = tokenizers.Tokenizer.from_file(str(bundle.tokenizer_file))
        text = CORPUS.read_text() if CORPUS.is_file() else "The quick brown fox jumps over the lazy dog. " * 400
        ids = self.count_ids(text)
        while len(ids) < 2 * bundle.max_input_len + 64:
            text += "\n\n" + text
            ids = self.count_ids(text)
        self._corpus_ids = ids
        rng = random.Random(seed)
        top = bundle.max_input_len
        # short / medium / long / at the limit
        lengths = [rng.randint(1, min(32, top)) for _ in range(size // 2)]
        lengths += [rng.randint(min(33, top), min(256, top)) for _ in range(size // 4)]
        lengths += [rng.randint(min(257, top), top) for _ in range(size - len(lengths) - 3)]
        lengths += [top, top, max(1, top - 1)]
        self.prompts: list[Prompt] = []
        for i, n in enumerate(lengths):
            text, count = self.text_of_length(n, rng)
            self.prompts.append(Prompt(i, text, count))
        self.weights = [0.5 / (size // 2)] * (size // 2) + [0.3 / (size // 4)] * (size // 4)
        rest = len(self.prompts) - len(self.weights)
        self.weights += [0.2 / rest] * rest
        over, count = self.text_of_length(top + 16, rng)
        self.over_limit = Prompt(-1, over, count)

    def count_ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def text_of_length(self, n: int, rng: random.Random) -> tuple[str, int]:
        """A corpus slice whose own encoding is exactly ``n`` tokens when possible (never more)."""
        best = ("", 0)
        for _ in range(20):
            start = rng.randrange(0, len(self._corpus_ids) - n - 1)
            want = n
            for _ in range(8):
                text = self.tok.decode(self._corpus_ids[start:start + want])
                count = len(self.count_ids(text))
                if count == n and text.strip():
                    return text, count
                if 0 < count < n and count > best[1] and text.strip():
                    best = (text, count)
                want += 1 if count < n else -1
                if want < 1:
                    break
        if not best[0]:
            raise RuntimeError(f"cannot cut a {n}-token prompt from the corpus")
        return best

    def pick(self, rng: random.Random) -> Prompt:
        return rng.choices(self.prompts, weights=self.weights, k=1)[0]


MAX_TOKENS_CHOICES = (1, 2, 4, 8, 16, 32, 64, 96, 128)


@dataclass(slots=True)
class Spec:
    """One valid request: what is sent and what the response is checked against."""

    prompt: Prompt
    max_tokens: int
    sampling: dict[str, Any]
    greedy: bool
    max_tokens_as_input: bool  # the INT32 max_tokens input rather than sampling_parameters["max_tokens"]
    exclude_input: bool | None

    @property
    def greedy_key(self) -> tuple[int, int] | None:
        return (self.prompt.index, self.max_tokens) if self.greedy else None

    def request_dict(self) -> dict[str, Any]:
        """The request as named inputs (the HTTP generate JSON and the gRPC inputs are built from it)."""
        req: dict[str, Any] = {"text_input": self.prompt.text, "stream": True}
        sampling = dict(self.sampling)
        if self.max_tokens_as_input:
            req["max_tokens"] = self.max_tokens
        else:
            sampling["max_tokens"] = self.max_tokens
        if sampling:
            req["sampling_parameters"] = json.dumps(sampling)
        if self.exclude_input is not None:
            req["exclude_input_in_output"] = self.exclude_input
        return req


def make_spec(pool: PromptPool, rng: random.Random) -> Spec:
    prompt = pool.pick(rng)
    room = pool.bundle.max_seq_len - prompt.tokens
    max_tokens = max(1, min(rng.choice(MAX_TOKENS_CHOICES), room))
    greedy = rng.random() < 0.5
    if greedy:
        sampling: dict[str, Any] = rng.choice([{"temperature": 0}, {"temperature": 0.0, "top_k": 0}, {}])
    else:
        sampling = {"temperature": rng.choice([0.6, 0.8, 1.0, 1.3]), "top_p": rng.choice([0.8, 0.95, 1.0]),
                    "top_k": rng.choice([0, 20, 50])}
        if rng.random() < 0.5:
            sampling["seed"] = rng.randrange(2**31)
        if rng.random() < 0.2:
            sampling["temperature"] = str(sampling["temperature"])  # numbers as strings, as vLLM accepts them
    return Spec(prompt, max_tokens, sampling, greedy, rng.random() < 0.5, rng.choice([None, True]))


# ---- checks -------------------------------------------------------------------------------------------

def check_result(spec: Spec, ids: list[int], text: str, finish_reason: str | None) -> list[str]:
    """Problems with a finished valid response (empty list: it is fine)."""
    problems = []
    if finish_reason not in FINISH_REASONS:
        problems.append(f"finish_reason {finish_reason!r} not in {FINISH_REASONS}")
    if not ids:
        problems.append("no tokens")
    if len(ids) > spec.max_tokens:
        problems.append(f"{len(ids)} tokens > max_tokens {spec.max_tokens}")
    if finish_reason == "length":
        if len(ids) != spec.max_tokens:
            problems.append(f"finish_reason length after {len(ids)} of max_tokens {spec.max_tokens}")
        if not text:
            problems.append("finish_reason length with empty text")
    return problems


class GreedyBook:
    """First greedy output per (prompt, max_tokens); later ones must match it (same prompt, same ids)."""

    def __init__(self) -> None:
        self._ref: dict[tuple[int, int], tuple[int, ...]] = {}
        self.checked = 0
        self.mismatches = 0
        self.examples: list[dict[str, Any]] = []

    def check(self, key: tuple[int, int] | None, ids: list[int]) -> str | None:
        if key is None:
            return None
        ref = self._ref.setdefault(key, tuple(ids))
        self.checked += 1
        if ref == tuple(ids):
            return None
        self.mismatches += 1
        at = next((i for i, (a, b) in enumerate(zip(ref, ids)) if a != b), min(len(ref), len(ids)))
        if len(self.examples) < 10:
            self.examples.append({"prompt": key[0], "max_tokens": key[1], "first_difference_at": at,
                                  "reference_len": len(ref), "got_len": len(ids)})
        return f"greedy output differs from an earlier identical request at token {at}"


# ---- gRPC --------------------------------------------------------------------------------------------

GRPC_TYPES = {"text_input": ("BYTES", np.object_), "sampling_parameters": ("BYTES", np.object_),
              "input_ids": ("INT32", np.int32), "max_tokens": ("INT32", np.int32),
              "stream": ("BOOL", np.bool_), "exclude_input_in_output": ("BOOL", np.bool_)}


def grpc_input(name: str, value: Any, datatype: str | None = None, shape: list[int] | None = None):
    """One tritonclient InferInput; ``datatype``/``shape`` may deliberately disagree with the model's."""
    import tritonclient.grpc as grpcclient

    dt, np_type = GRPC_TYPES.get(name, ("BYTES", np.object_))
    dt = datatype or dt
    if dt == "BYTES":
        values = value if isinstance(value, list) else [value]
        arr = np.array([v.encode("utf-8") if isinstance(v, str) else v for v in values], dtype=np.object_)
    else:
        np_type = {"INT32": np.int32, "BOOL": np.bool_, "FP32": np.float32, "INT64": np.int64}.get(dt, np_type)
        arr = np.array(value if isinstance(value, list) else [value], dtype=np_type)
    if shape is not None:
        arr = arr.reshape(shape)
    inp = grpcclient.InferInput(name, list(arr.shape), dt)
    inp.set_data_from_numpy(arr)
    return inp


def grpc_inputs(request: dict[str, Any]) -> list:
    return [grpc_input(name, value) for name, value in request.items()]


@dataclass(slots=True)
class Reply:
    """One response of a stream: token ids and text delta, or an error; ``final`` on the last one."""

    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    final: bool = False
    error: str | None = None
    t: float = 0.0


class StreamTimeout(TimeoutError):
    pass


class GrpcStream:
    """One tritonclient gRPC client and bidirectional stream; one request in flight at a time.

    A stream that was cancelled, timed out or broke is torn down and reopened for the next request, so
    a late response can never be taken for the next request's. Works under gevent (locust, after
    ``grpc.experimental.gevent.init_gevent()``) and with plain threads (the soak runner's warm-up).
    """

    def __init__(self, url: str, model: str = MODEL) -> None:
        self.url, self.model = url, model
        self._client: Any = None
        self._queue: queue.Queue | None = None
        self.streams_opened = 0
        self.in_flight = False  # a request was sent and its final response has not arrived

    def _open(self) -> None:
        import tritonclient.grpc as grpcclient

        q: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.url)
        client.start_stream(callback=lambda result, error: q.put((result, error, time.perf_counter())))
        self._client, self._queue = client, q
        self.streams_opened += 1

    def send(self, inputs: list) -> str:
        """Send one request on the stream (opened if needed); returns its request id."""
        if self._client is None:
            self._open()
        request_id = uuid.uuid4().hex
        self.in_flight = True
        self._client.async_stream_infer(self.model, inputs, request_id=request_id, enable_empty_final_response=True)
        return request_id

    def generate(self, inputs: list, timeout: float = 120.0) -> Iterator[Reply]:
        """Send one request and yield its replies until the final one (or an error, which ends it)."""
        request_id = self.send(inputs)
        return self.replies(request_id, timeout)

    def replies(self, request_id: str, timeout: float) -> Iterator[Reply]:
        assert self._queue is not None
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise queue.Empty
                result, error, t = self._queue.get(timeout=remaining)
            except queue.Empty:
                self.reset(cancel=True)
                raise StreamTimeout(f"no response within {timeout:.0f} s") from None
            if error is not None:
                message = error.message() if hasattr(error, "message") else str(error)
                self.in_flight = False
                yield Reply(final=True, error=str(message), t=t)
                return
            response = result.get_response()
            if response.id and response.id != request_id:
                continue  # cannot happen on a fresh stream; never mix requests up
            final = response.parameters["triton_final_response"].bool_param
            if final:
                self.in_flight = False
            ids = result.as_numpy("output_ids")
            text = result.as_numpy("text_output")
            reason = result.as_numpy("finish_reason")
            yield Reply(ids=[] if ids is None else [int(x) for x in ids.reshape(-1)],
                        text=text.reshape(-1)[0].decode("utf-8", errors="replace") if text is not None and text.size
                        else "",
                        finish_reason=reason.reshape(-1)[0].decode() if reason is not None and reason.size else None,
                        final=final, t=t)
            if final:
                return

    def reset(self, cancel: bool | None = None) -> None:
        """Close the stream and the client; ``stop_stream(cancel_requests=...)`` gets ``cancel``, by default
        True only while a request is in flight (a careful client does not cancel a finished stream)."""
        client, self._client, self._queue = self._client, None, None
        cancel = self.in_flight if cancel is None else cancel
        self.in_flight = False
        if client is not None:
            try:
                client.stop_stream(cancel_requests=cancel)
            finally:
                client.close()

    close = reset


# ---- HTTP server-sent events ------------------------------------------------------------------------

def sse_payload(line: bytes) -> dict[str, Any] | None:
    """The JSON object of one ``data:`` line of Triton's generate_stream (None for other lines)."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    return json.loads(line[5:].strip() or b"{}")


def reply_from_sse(obj: dict[str, Any], t: float) -> Reply:
    if "error" in obj:
        return Reply(final=True, error=str(obj["error"]), t=t)
    ids = obj.get("output_ids", [])
    ids = [ids] if isinstance(ids, int) else [int(x) for x in ids]
    text = obj.get("text_output", "")
    text = "".join(text) if isinstance(text, list) else str(text)
    reason = obj.get("finish_reason") or None
    if isinstance(reason, list):
        reason = reason[0] if reason else None
    return Reply(ids=ids, text=text, finish_reason=reason, final=reason is not None, t=t)


# ---- statistics -----------------------------------------------------------------------------------------

class LogHistogram:
    """Counts in buckets 1 % wide (in log space) from 10 µs: percentiles within 1 % in bounded memory."""

    BASE = 1e-5
    STEP = math.log(1.01)

    def __init__(self) -> None:
        self.counts: Counter[int] = Counter()
        self.n = 0
        self.total = 0.0
        self.max = 0.0

    def add(self, seconds: float) -> None:
        b = 0 if seconds <= self.BASE else int(math.log(seconds / self.BASE) / self.STEP) + 1
        self.counts[b] += 1
        self.n += 1
        self.total += seconds
        self.max = max(self.max, seconds)

    def percentile(self, q: float) -> float | None:
        if not self.n:
            return None
        rank = max(1, math.ceil(q / 100.0 * self.n))
        seen = 0
        for b in sorted(self.counts):
            seen += self.counts[b]
            if seen >= rank:
                return self.BASE * math.exp(self.STEP * (b - 0.5)) if b else self.BASE
        return self.max

    def summary(self) -> dict[str, Any]:
        def ms(v: float | None) -> float | None:
            return None if v is None else round(v * 1000.0, 3)

        return {"count": self.n, "mean_ms": ms(self.total / self.n) if self.n else None,
                "p50_ms": ms(self.percentile(50)), "p90_ms": ms(self.percentile(90)),
                "p99_ms": ms(self.percentile(99)), "max_ms": ms(self.max) if self.n else None}


FAULT_OUTCOMES = ("expected", "unexpected_success", "wrong_error")


class SoakStats:
    """What the locust process counts (all greenlets of one process: a lock is cheap and safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.valid: Counter[str] = Counter()  # "<transport>:ok" / "<transport>:failed"
        self.failure_reasons: Counter[str] = Counter()
        self.faults: dict[str, Counter[str]] = {}
        self.fault_examples: list[dict[str, str]] = []
        self.latency: dict[str, LogHistogram] = {}
        self.tokens = 0
        self.greedy = GreedyBook()
        self.t_start = time.time()

    def hist(self, name: str) -> LogHistogram:
        h = self.latency.get(name)
        if h is None:
            h = self.latency[name] = LogHistogram()
        return h

    def record_valid(self, transport: str, ok: bool, reasons: list[str] = ()) -> None:  # type: ignore[assignment]
        with self.lock:
            self.valid[f"{transport}:{'ok' if ok else 'failed'}"] += 1
            for r in reasons:
                self.failure_reasons[f"{transport}: {_squash(r)}"] += 1

    def record_tokens(self, transport: str, ttft: float | None, itls: list[float], e2e: float, tokens: int) -> None:
        with self.lock:
            self.tokens += tokens
            if ttft is not None:
                self.hist("ttft").add(ttft)
                self.hist(f"ttft:{transport}").add(ttft)
            for x in itls:
                self.hist("itl").add(x)
                self.hist(f"itl:{transport}").add(x)
            self.hist("e2e").add(e2e)

    def record_fault(self, kind: str, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.faults.setdefault(kind, Counter())[outcome] += 1
            if outcome != "expected" and len(self.fault_examples) < 50:
                self.fault_examples.append({"kind": kind, "outcome": outcome, "detail": detail[:300]})

    def to_json(self) -> dict[str, Any]:
        with self.lock:
            return {
                "wall_s": round(time.time() - self.t_start, 1),
                "valid": dict(self.valid),
                "failure_reasons": dict(self.failure_reasons.most_common(50)),
                "tokens": self.tokens,
                "faults": {k: {o: int(c.get(o, 0)) for o in FAULT_OUTCOMES} for k, c in sorted(self.faults.items())},
                "fault_examples": list(self.fault_examples),
                "latency": {k: h.summary() for k, h in sorted(self.latency.items())},
                "greedy": {"checked": self.greedy.checked, "mismatches": self.greedy.mismatches,
                           "examples": list(self.greedy.examples)},
            }


def _squash(text: str) -> str:
    """Group failure messages: digits folded so '17 tokens > 16' and '9 tokens > 8' count together."""
    return re.sub(r"\d+", "N", text)[:200]
