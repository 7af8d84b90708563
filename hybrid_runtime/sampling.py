"""Per-request sampling parameters, parsed from the vLLM Triton backend's ``sampling_parameters`` JSON.

`SamplingParams` validates itself at construction; `SamplingParams.from_json` is the strict parser for
client input. Every problem with client input raises `RequestValidationError` (a ``ValueError``) whose
message names the offending field, so the server can map it to an ``INVALID_ARG`` response.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

MAX_STOP_STRINGS = 16
MAX_SEED = 2**63  # exclusive
MAX_LOGPROBS = 20  # most likely tokens returned per position (OpenAI's top_logprobs limit, vLLM's default)

_BOOL_STRINGS = {"true": True, "false": False}


class RequestValidationError(ValueError):
    """Bad client input. ``code`` is a machine-readable kind, ``field`` the offending key (if any)."""

    def __init__(self, message: str, *, code: str = "invalid_argument", field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field


def _fail(field: str, value: Any, why: str, code: str = "invalid_argument") -> RequestValidationError:
    return RequestValidationError(f"invalid sampling parameter {field}={value!r}: {why}", code=code, field=field)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next tokens of one request.

    ``temperature == 0`` is greedy decoding; ``top_k == 0`` and ``top_p == 1`` switch those filters off.
    ``stop`` strings end generation when they appear in the output text (they are not returned);
    ``stop_token_ids`` do the same for token ids, in addition to the model's EOS unless ``ignore_eos``.
    No stop condition (EOS, stop ids, stop strings) is honoured before ``min_tokens`` tokens.
    ``logprobs``: None = none returned; 0 = the sampled token's log-probability only; N in 1..20 = that
    plus the N most likely tokens (see `hybrid_runtime.sampler.token_logprobs`).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Normalise sequences to tuples so that instances stay hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise _fail("max_tokens", self.max_tokens, "must be an integer >= 1")
        if (not isinstance(self.temperature, int | float) or isinstance(self.temperature, bool)
                or not math.isfinite(self.temperature) or not 0.0 <= self.temperature <= 100.0):
            raise _fail("temperature", self.temperature, "must be a number in [0, 100] (0 = greedy)")
        if not is_int(self.top_k) or self.top_k < 0:
            raise _fail("top_k", self.top_k, "must be an integer >= 0 (0 = off)")
        if (not isinstance(self.top_p, int | float) or isinstance(self.top_p, bool)
                or not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0):
            raise _fail("top_p", self.top_p, "must be a number in (0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise _fail("seed", self.seed, "must be null or an integer in [0, 2**63)")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise _fail("stop", list(self.stop), f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _fail("stop", list(self.stop), "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            if not is_int(t) or t < 0:
                raise _fail("stop_token_ids", list(self.stop_token_ids), "must be non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            raise _fail("ignore_eos", self.ignore_eos, "must be a boolean")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise _fail("min_tokens", self.min_tokens, f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise _fail("logprobs", self.logprobs, f"must be null or an integer in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0, or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def from_json(cls, text: str | bytes | dict[str, Any] | None, defaults: SamplingParams | None = None,
                  max_tokens_limit: int | None = None) -> SamplingParams:
        """Parse the ``sampling_parameters`` JSON object of a request.

        ``text`` may be the JSON text (str or UTF-8 bytes), an already-decoded dict, or None / empty (all
        defaults). Keys that are absent or null take their value from ``defaults``. Numbers may be given
        as strings (``"0.7"``), booleans as ``"true"``/``"false"``, ``stop`` as one string or a list;
        ``top_k = -1`` (vLLM's "off") is read as 0. Accepted vLLM keys that this server does not implement
        (``n``, ``best_of``, penalties) must carry their neutral value.
        Raises `RequestValidationError` for anything else, including ``max_tokens > max_tokens_limit``.
        """
        obj = _load_object(text)
        base = defaults if defaults is not None else cls()
        unknown = sorted(set(obj) - set(_PARSERS) - set(_NEUTRAL))
        if unknown:
            raise RequestValidationError(
                f"unknown sampling parameter(s) {unknown}; supported keys are "
                f"{sorted(_PARSERS)} (and {sorted(_NEUTRAL)} with their neutral values only)",
                code="invalid_argument", field=unknown[0])
        for key, neutral in _NEUTRAL.items():
            value = obj.get(key)
            if value is None:
                continue
            if _as_float(key, value) != neutral:
                raise _fail(key, value, f"is not supported by this server (only {json.dumps(neutral)} is accepted)",
                            code="unsupported")
        updates = {key: _PARSERS[key](key, obj[key]) for key in _PARSERS if obj.get(key) is not None}
        try:
            params = dataclasses.replace(base, **updates)
        except TypeError as e:  # pragma: no cover - parsers return the right types
            raise RequestValidationError(str(e)) from e
        if max_tokens_limit is not None and params.max_tokens > max_tokens_limit:
            raise _fail("max_tokens", params.max_tokens, f"exceeds this server's limit of {max_tokens_limit}")
        return params


def _load_object(text: str | bytes | dict[str, Any] | None) -> dict[str, Any]:
    if text is None:
        return {}
    if isinstance(text, dict):
        obj: Any = text
    else:
        if isinstance(text, bytes | bytearray):
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError as e:
                raise RequestValidationError(f"sampling_parameters is not valid UTF-8: {e}",
                                             field="sampling_parameters") from e
        if not isinstance(text, str):
            raise RequestValidationError(f"sampling_parameters must be a JSON string, got {type(text).__name__}",
                                         field="sampling_parameters")
        if not text.strip():
            return {}
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise RequestValidationError(f"sampling_parameters is not valid JSON: {e}",
                                         field="sampling_parameters") from e
    if not isinstance(obj, dict):
        raise RequestValidationError(f"sampling_parameters must be a JSON object, got {type(obj).__name__}",
                                     field="sampling_parameters")
    return obj


def _as_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise _fail(key, value, "must be a number, not a boolean")
    if isinstance(value, int | float):
        out = float(value)
    elif isinstance(value, str):
        try:
            out = float(value.strip())
        except ValueError:
            raise _fail(key, value, "must be a number") from None
    else:
        raise _fail(key, value, "must be a number")
    if not math.isfinite(out):
        raise _fail(key, value, "must be a finite number")
    return out


def _as_int(key: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        s = value.strip()
        try:
            return int(s)
        except ValueError:
            pass
    f = _as_float(key, value)
    if not f.is_integer():
        raise _fail(key, value, "must be an integer")
    return int(f)


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _BOOL_STRINGS:
        return _BOOL_STRINGS[value.strip().lower()]
    raise _fail(key, value, "must be true or false")


def _as_stop(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise _fail(key, value, "must be a string or a list of strings")


def _as_int_list(key: str, value: Any) -> tuple[int, ...]:
    items = value if isinstance(value, list) else [value]
    return tuple(_as_int(key, v) for v in items)


def _as_top_k(key: str, value: Any) -> int:
    k = _as_int(key, value)
    return 0 if k == -1 else k


_PARSERS = {
    "max_tokens": _as_int,
    "temperature": _as_float,
    "top_k": _as_top_k,
    "top_p": _as_float,
    "seed": _as_int,
    "stop": _as_stop,
    "stop_token_ids": _as_int_list,
    "ignore_eos": _as_bool,
    "min_tokens": _as_int,
    "logprobs": _as_int,
}

# vLLM keys accepted only with their neutral value.
_NEUTRAL: dict[str, float] = {
    "n": 1.0,
    "best_of": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}
