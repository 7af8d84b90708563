"""The Triton-independent half of ``model_repository/hybrid_llm/1/model.py``.

Everything here is plain Python over numpy arrays, so it is unit-tested without a server:

* :func:`parse_parameters` — the one typed parser for the ``parameters`` of config.pbtxt; a bad value
  raises :class:`ParameterError` naming the key, the value and what to write instead (the model then
  fails to load with that message).
* :func:`parse_request` — Triton input tensors (vLLM backend convention) -> :class:`ParsedRequest`;
  every problem raises ``RequestValidationError`` (sent back to that client only as INVALID_ARG).
* :class:`ReplyBuilder` — one request's runtime events -> :class:`Reply` objects (streamed deltas, or
  one final reply carrying the whole text).
* :class:`LogprobsEncoder` — a response's token log-probabilities -> the ``output_logprobs`` JSON.

The threads around in-flight requests (sending, cancellation polling) live in ``deploy.inflight``.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hybrid_runtime.config import ConfigError
from hybrid_runtime.engine.base import PINNING_MODES
from hybrid_runtime.ops.base import parse_device
from hybrid_runtime.runner import PACKED_WEIGHTS
from hybrid_runtime.sampler import TokenLogprobs
from hybrid_runtime.sampling import RequestValidationError, SamplingParams
from hybrid_runtime.serving import ASYNC_SCHEDULING_MODES, MULTI_BLOCK_MODES, Event, GenerationRequest, RuntimeOptions

DEFAULT_ENGINE_DIR = "../../engines/default"
LOG_LEVELS = ("debug", "info", "warning", "error")


class ParameterError(ConfigError):
    """A config.pbtxt parameter has a value the model cannot use: the model refuses to load."""


# ---- config.pbtxt parameters ----------------------------------------------------------------------

def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text.strip())
        if value < minimum:
            raise ValueError
        return value
    return parse


def _choice(options: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in options:
            raise ValueError
        return value
    return parse


def _boolean(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        raise ValueError
    return value in ("true", "1", "yes", "on")


def _device(text: str) -> str:
    value = text.strip().lower()
    if value != "auto":
        parse_device(value)  # ConfigError (a ValueError) unless cpu | cuda | cuda:N
    return value


def _fraction(text: str) -> float:
    value = float(text.strip())
    if not 0.0 <= value <= 1.0:
        raise ValueError
    return value


def _seconds_at_least_0(text: str) -> float:
    value = float(text.strip())
    if not value >= 0.0 or value == float("inf"):  # NaN and inf refused too
        raise ValueError
    return value


_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def _bytes(text: str) -> int:
    m = _SIZE.match(text)
    if m is None:
        raise ValueError
    return int(m.group(1)) * 1024 ** " kmgt".index((m.group(2) or " ").lower())


# key -> (parser, what a valid value looks like). The model directory resolves engine_dir separately.
_PARAMETERS: dict[str, tuple[Callable[[str], Any], str]] = {
    "engine_dir": (str, "a bundle directory, absolute or relative to the model directory"),
    "max_batch_size": (_int_at_least(0), "an integer >= 0 (0 = the bundle's max batch size)"),
    "multi_block_mode": (_choice(MULTI_BLOCK_MODES), f"one of {', '.join(MULTI_BLOCK_MODES)}"),
    "profile_pinning": (_choice(PINNING_MODES), f"one of {', '.join(PINNING_MODES)}"),
    "default_max_tokens": (_int_at_least(1), "an integer >= 1"),
    "kv_cache_bytes": (_bytes, "a byte count such as 268435456 or 256M (0 = the bundle's KV pool)"),
    "log_level": (_choice(LOG_LEVELS), f"one of {', '.join(LOG_LEVELS)}"),
    "intra_op_threads": (_int_at_least(0), "an integer >= 0 (0 = onnxruntime's default)"),
    "device": (_device, "auto, cpu, cuda or cuda:N"),
    "gpu_memory_fraction": (_fraction, "a number in [0, 1] such as 0.9 (0 = the bundle's KV page count)"),
    "heap_trim_interval_s": (_seconds_at_least_0, "seconds >= 0 such as 60 (0 = never return freed heap memory)"),
    "warmup": (_boolean, "true or false"),
    "packed_weights": (_choice(PACKED_WEIGHTS), f"one of {', '.join(PACKED_WEIGHTS)}"),
    "async_scheduling": (_choice(ASYNC_SCHEDULING_MODES), f"one of {', '.join(ASYNC_SCHEDULING_MODES)}"),
    "heap_debug_dir": (str, "a directory for heap snapshots (empty = heap debugging off)"),
    "heap_snapshot_period_s": (_int_at_least(1), "an integer >= 1 (seconds between heap snapshots)"),
}


@dataclass(frozen=True, slots=True)
class ModelParameters:
    """The model's deployment settings, read from config.pbtxt ``parameters``."""

    engine_dir: Path
    max_batch_size: int = 0
    multi_block_mode: str = "auto"
    profile_pinning: str = "per_context"
    default_max_tokens: int = 16
    kv_cache_bytes: int = 0
    log_level: str = "info"
    intra_op_threads: int = 0
    device: str = "auto"
    gpu_memory_fraction: float = 0.9
    heap_trim_interval_s: float = 60.0
    warmup: bool = True
    heap_debug_dir: Path | None = None  # set: tracemalloc on, heap gauges, snapshots (deploy.heap_debug)
    heap_snapshot_period_s: int = 300
    packed_weights: str = "auto"
    async_scheduling: str = "auto"

    def runtime_options(self, instance_kind: str = "CPU", instance_device_id: int = 0) -> RuntimeOptions:
        """The runtime's options for one model instance (``instance_kind`` / ``instance_device_id``: Triton's
        ``model_instance_kind`` / ``model_instance_device_id`` of that instance)."""
        return RuntimeOptions(max_batch_size=self.max_batch_size, multi_block_mode=self.multi_block_mode,
                              profile_pinning=self.profile_pinning, default_max_tokens=self.default_max_tokens,
                              kv_cache_bytes=self.kv_cache_bytes, intra_op_threads=self.intra_op_threads,
                              device=instance_device(self.device, instance_kind, instance_device_id),
                              gpu_memory_fraction=self.gpu_memory_fraction,
                              heap_trim_interval_s=self.heap_trim_interval_s, warmup=self.warmup,
                              packed_weights=self.packed_weights, async_scheduling=self.async_scheduling)


def instance_device(device: str, instance_kind: str, instance_device_id: int) -> str:
    """The runtime device of one model instance. A KIND_GPU instance (Triton makes one per GPU of its
    ``instance_group``) runs on its own GPU: ``auto`` and ``cuda`` become ``cuda:<its device id>``; an
    explicit ``cuda:N`` or ``cpu`` is kept (a KIND_CPU instance with ``device=cuda:N`` is the other way to
    place instances). Elsewhere ``auto`` is left to the runtime (a cuda bundle on GPU 0, else the CPU)."""
    if instance_kind.upper() == "GPU" and device in ("auto", "cuda"):
        return f"cuda:{int(instance_device_id)}"
    return device


def parse_parameters(model_config: Mapping[str, Any], model_dir: str | Path) -> ModelParameters:
    """Parse ``model_config["parameters"]`` (Triton's JSON form: ``{key: {"string_value": ...}}``).

    Empty values keep the default. Unknown lower-case keys are refused (a typo must not be ignored);
    upper-case keys belong to the Python backend itself (e.g. ``EXECUTION_ENV_PATH``) and are skipped.
    """
    where = Path(model_dir) / "config.pbtxt"
    raw = {k: str((v or {}).get("string_value", "")) for k, v in (model_config.get("parameters") or {}).items()}
    unknown = sorted(k for k in raw if k not in _PARAMETERS and not k.isupper())
    if unknown:
        raise ParameterError(f"{where}: unknown parameter(s) {unknown}; the model understands {sorted(_PARAMETERS)}")
    values: dict[str, Any] = {}
    for key, text in raw.items():
        if key not in _PARAMETERS or not text.strip():
            continue
        parse, what = _PARAMETERS[key]
        try:
            values[key] = parse(text)
        except ValueError:
            raise ParameterError(f"{where}: parameter {key}={text!r} is invalid; expected {what}. Change "
                                 f'parameters {{ key: "{key}" value {{ string_value: "..." }} }}') from None
    if "heap_debug_dir" in values:
        heap_dir = Path(values["heap_debug_dir"]).expanduser()
        values["heap_debug_dir"] = heap_dir if heap_dir.is_absolute() else (Path(model_dir) / heap_dir).resolve()
    engine_dir = Path(values.pop("engine_dir", DEFAULT_ENGINE_DIR)).expanduser()
    if not engine_dir.is_absolute():
        engine_dir = (Path(model_dir) / engine_dir).resolve()
    if not engine_dir.is_dir():
        raise ParameterError(f"{where}: engine_dir resolves to {engine_dir}, which is not a directory; build a bundle "
                             f"there (python -m builder build ... --output {engine_dir}) or point engine_dir at one")
    return ModelParameters(engine_dir=engine_dir, **values)


def configure_logging(level: str, name: str = "hybrid_llm") -> None:
    """Send the runtime's and the adapter's log records to stderr (the server's log) at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[{name}] %(levelname)s %(name)s: %(message)s"))
    for logger_name in ("hybrid_runtime", "deploy"):
        logger = logging.getLogger(logger_name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False


# ---- requests ---------------------------------------------------------------------------------------

TensorGetter = Callable[[str], "np.ndarray | None"]


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """One validated client request, in the runtime's terms."""

    prompt: str | None
    prompt_ids: tuple[int, ...] | None
    params: SamplingParams
    stream: bool
    prepend_prompt: bool  # non-streamed text_output starts with the prompt (vLLM backend default)

    def generation_request(self, request_id: str) -> GenerationRequest:
        return GenerationRequest(request_id, prompt=self.prompt, prompt_ids=self.prompt_ids, params=self.params)


def _invalid(name: str, why: str) -> RequestValidationError:
    return RequestValidationError(f"input {name}: {why}", field=name)


def _one(get: TensorGetter, name: str, kinds: str) -> Any:
    """The single element of input ``name`` (None when absent), checked against numpy dtype ``kinds``."""
    arr = get(name)
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.size != 1:
        raise _invalid(name, f"must hold exactly one element, got shape {list(arr.shape)}")
    if arr.dtype.kind not in kinds:
        raise _invalid(name, f"has the wrong data type {arr.dtype}")
    return arr.reshape(-1)[0]


def _utf8(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise _invalid(name, f"is not valid UTF-8 (bad byte at offset {e.start}); send UTF-8 text") from None


def parse_request(get: TensorGetter, default_max_tokens: int = 16) -> ParsedRequest:
    """Read a request's inputs; ``get(name)`` returns the input's numpy array or None when absent."""
    text = _one(get, "text_input", "OSU")
    ids_arr = get("input_ids")
    if (text is None) == (ids_arr is None):
        raise RequestValidationError("give exactly one of text_input or input_ids" +
                                     (", not both" if text is not None else ""), field="text_input")
    prompt = prompt_ids = None
    if text is not None:
        prompt = _utf8("text_input", text)
    else:
        ids = np.asarray(ids_arr)
        if ids.dtype.kind not in "iu":
            raise _invalid("input_ids", f"has the wrong data type {ids.dtype}; send INT32 token ids")
        prompt_ids = tuple(int(t) for t in ids.reshape(-1))

    stream = bool(_one(get, "stream", "b") or False)
    exclude = _one(get, "exclude_input_in_output", "b")
    # vLLM backend convention: the prompt is prepended to non-streamed output unless excluded; when
    # streaming it is never prepended, and asking for it is an error.
    prepend = not stream if exclude is None else not bool(exclude)
    if prepend and stream:
        raise _invalid("exclude_input_in_output", "false is not allowed when streaming")

    max_tokens = _one(get, "max_tokens", "iu")
    if max_tokens is not None and int(max_tokens) < 1:
        raise _invalid("max_tokens", f"must be >= 1, got {int(max_tokens)}")
    defaults = SamplingParams(max_tokens=int(max_tokens) if max_tokens is not None else default_max_tokens)
    sampling = _one(get, "sampling_parameters", "OSU")
    params = SamplingParams.from_json(sampling, defaults=defaults)
    if max_tokens is not None and params.max_tokens != int(max_tokens):
        raise _invalid("max_tokens", f"{int(max_tokens)} conflicts with sampling_parameters max_tokens="
                                     f"{params.max_tokens}; give one of them")
    return ParsedRequest(prompt, prompt_ids, params, stream, prepend)


# ---- responses --------------------------------------------------------------------------------------

# RequestValidationError.code -> TritonError code name; anything else is INTERNAL.
ERROR_CODES = {"invalid_argument": "INVALID_ARG", "unsupported": "INVALID_ARG", "unavailable": "UNAVAILABLE"}


def triton_error(message: str, code: str) -> tuple[str, str]:
    """``(TritonError code name, message)`` of an error response; the message starts with the code in
    brackets (``[INVALID_ARG] the prompt is empty``). Triton 2.51's gRPC stream passes an error's message
    but not its code, and Triton's ``triton_grpc_error`` header (which would carry it as the gRPC status)
    crashes the server once streams have been cancelled (deploy/README.md), so the code travels in the
    text: the OpenAI frontend maps it to an HTTP status."""
    name = ERROR_CODES.get(code, "INTERNAL")
    return name, f"[{name}] {message}"


@dataclass(frozen=True, slots=True)
class Reply:
    """One Triton response: output arrays, or an error; ``final`` marks the request's last response."""

    outputs: dict[str, np.ndarray]
    final: bool
    error: str | None = None
    error_code: str = "internal"


def outputs(text: str, ids: tuple[int, ...] | list[int], finish_reason: str | None = None, *,
            logprobs: bytes | None = None, num_input_tokens: int | None = None) -> dict[str, np.ndarray]:
    """The output tensors of one response (config.pbtxt documents each one).

    No tensor is ever empty: ``output_ids`` is left out of a response that carries no ids (a final response
    whose ids were all sent already, a request cancelled before its first token). Triton 2.51's HTTP frontend
    leaks its bookkeeping of every zero-byte output buffer (an ``OutputInfo``, ~80 bytes of heap per output,
    for as long as the server runs: deploy/README.md); the clients here read a missing ``output_ids`` as none.
    """
    out = {"text_output": np.array([text.encode("utf-8")], dtype=np.object_)}
    if len(ids):
        out["output_ids"] = np.array(ids, dtype=np.int32)
    if finish_reason is not None:
        out["finish_reason"] = np.array([finish_reason.encode("utf-8")], dtype=np.object_)
    if logprobs is not None:
        out["output_logprobs"] = np.array([logprobs], dtype=np.object_)
    if num_input_tokens is not None:
        out["num_input_tokens"] = np.array([num_input_tokens], dtype=np.int32)
    return out


NEG_INF_LOGPROB = -9999.0  # JSON has no -inf: a masked token's logprob is sent as this (vLLM's stand-in)


def token_text(raw: bytes) -> str:
    """A token's text for logprob listings: its UTF-8, or ``bytes:\\xNN..`` for a fragment of a character
    (the form OpenAI's API uses for such tokens)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class LogprobsEncoder:
    """Encodes token log-probabilities as the ``output_logprobs`` JSON of a response.

    The document is a list with one object per id of the response's ``output_ids``, in order::

        {"token_id": 17, "token": "fox", "bytes": [102, 111, 120], "logprob": -0.12,
         "top_logprobs": [{"token_id": 17, "token": "fox", "bytes": [102, 111, 120], "logprob": -0.12}, ...]}

    ``token`` is :func:`token_text` of ``bytes``; ``top_logprobs`` holds the request's ``logprobs`` most
    likely tokens by descending logprob (empty for 0). ``token_bytes(id)`` gives a token's bytes (the
    runtime tokenizer's `token_bytes`); the per-token JSON is cached, since the engine thread builds it.
    """

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._heads: dict[int, str] = {}

    def _head(self, token_id: int) -> str:
        head = self._heads.get(token_id)
        if head is None:
            raw = self._token_bytes(token_id)
            head = (f'"token_id":{token_id},"token":{json.dumps(token_text(raw), ensure_ascii=False)},'
                    f'"bytes":{json.dumps(list(raw), separators=(",", ":"))}')
            self._heads[token_id] = head
        return head

    def encode(self, ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> bytes:
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} ids but {len(logprobs)} logprobs")
        items = []
        for token_id, lp in zip(ids, logprobs):
            top = ",".join(f'{{{self._head(t)},"logprob":{_number(v)}}}' for t, v in lp.top)
            items.append(f'{{{self._head(int(token_id))},"logprob":{_number(lp.logprob)},"top_logprobs":[{top}]}}')
        return ("[" + ",".join(items) + "]").encode("utf-8")


def _number(value: float) -> str:
    return repr(float(value)) if math.isfinite(value) else repr(NEG_INF_LOGPROB)


class ReplyBuilder:
    """Turns one request's runtime events into replies.

    Streamed: one reply per token event (the text delta and its ids); the request's last reply carries
    the final flag, ``finish_reason`` and the ids not yet sent (an EOS id has no token event). The token
    that reaches ``max_tokens`` is held back and sent *with* the final flag (its final event follows at
    once, on the same engine call): a separate empty final response lets a client's cancellation land
    between the two, which Triton 2.51's gRPC frontend mishandles (the model then never unloads).
    Not streamed: only the final reply, with the whole text (after the prompt when ``prepend_prompt``)
    and all ids. ``observe(kind, seconds)`` receives time-to-first-token ("ttft") and inter-token
    ("itl") samples. Every final reply carries ``num_input_tokens``; when the request asks for logprobs,
    every reply carries ``output_logprobs`` for its ids (``logprobs`` encodes them).
    """

    def __init__(self, request: ParsedRequest, prompt_text: str = "",
                 observe: Callable[[str, float], None] | None = None,
                 logprobs: LogprobsEncoder | None = None) -> None:
        self.stream = request.stream
        self.logprobs = logprobs if request.params.logprobs is not None else None
        self.max_tokens = request.params.max_tokens
        self.prefix = prompt_text if request.prepend_prompt else ""
        self.observe = observe
        self.ids_sent = 0
        self.held_text = ""
        self.t_start = self.t_last = time.perf_counter()
        self.tokens = 0

    def on_event(self, ev: Event) -> Reply | None:
        if not ev.final:
            now = time.perf_counter()
            if self.observe is not None:
                self.observe("itl" if self.tokens else "ttft", now - self.t_last)
            self.t_last, self.tokens = now, self.tokens + 1
            if not self.stream:
                return None
            if self.tokens >= self.max_tokens:  # the last token: it goes out with the final reply
                self.held_text += ev.text
                return None
            self.ids_sent += len(ev.token_ids)
            return Reply(outputs(ev.text, ev.token_ids, logprobs=self._logprobs(ev.token_ids, ev.logprobs)),
                         final=False)
        if ev.finish_reason == "error":
            return Reply({}, final=True, error=ev.error or "generation failed", error_code="internal")
        reason = ev.finish_reason or "stop"
        start = self.ids_sent if self.stream else 0
        ids = ev.output_ids[start:]
        text = self.held_text if self.stream else self.prefix + ev.text
        return Reply(outputs(text, ids, reason, logprobs=self._logprobs(ids, ev.logprobs[start:]),
                             num_input_tokens=ev.num_prompt_tokens), final=True)

    def _logprobs(self, ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> bytes | None:
        if self.logprobs is None:
            return None
        return self.logprobs.encode(ids, logprobs)
