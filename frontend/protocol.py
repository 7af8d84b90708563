"""OpenAI request bodies: parsed strictly, turned into the model's ``sampling_parameters``.

:func:`parse` validates a decoded JSON body against :class:`CompletionRequest` or
:class:`ChatCompletionRequest` and raises :class:`~frontend.errors.APIError` (400) naming the field for
anything wrong. Types are strict, as OpenAI's are (``"0.5"`` is not a number, ``1`` is not a boolean);
unknown fields are ignored, as OpenAI ignores them. Known OpenAI fields this server cannot honour
(``n`` > 1, ``echo``, ``best_of``, ``suffix``, penalties, ``logit_bias``, tools, a JSON response format)
are refused with a 400 that says so, rather than silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hybrid_runtime.sampling import MAX_LOGPROBS, MAX_SEED  # the server's limits (a stdlib-only module)

from .errors import APIError, invalid, unsupported

MAX_PROMPTS = 64  # prompts in one /v1/completions request (each is its own Triton stream)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Generation(_Strict):
    """Fields both routes share; the vLLM extensions (top_k, min_tokens, ignore_eos, stop_token_ids) too."""

    model: str = Field(min_length=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    stop: str | list[str] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = Field(None, ge=-1)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None

    def _check_common(self) -> None:
        if self.n not in (None, 1):
            raise unsupported("n", f"n={self.n} is not supported: this server returns exactly one choice (n must "
                                   "be 1); send several requests instead")
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise unsupported(name, f"{name}={value} is not supported by this server (only {neutral})")
        if self.logit_bias:
            raise unsupported("logit_bias", "logit_bias is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        if (isinstance(self.stop, list) and any(not s for s in self.stop)) or self.stop == "":
            raise invalid("stop strings must be non-empty", "stop")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _sampling(self, max_tokens: int | None, logprobs: int | None,
                  defaults: dict[str, Any]) -> dict[str, Any]:
        """The model's ``sampling_parameters``: given fields, else the model's defaults (see ModelInfo)."""
        out: dict[str, Any] = {}
        for key in ("temperature", "top_p", "top_k"):
            value = getattr(self, key)
            if value is None:
                value = defaults.get(key)
            if value is not None:
                out[key] = value
        if self.seed is not None:
            out["seed"] = self.seed
        if self.stop is not None:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.min_tokens is not None:
            out["min_tokens"] = self.min_tokens
        if self.ignore_eos is not None:
            out["ignore_eos"] = self.ignore_eos
        if max_tokens is not None:
            out["max_tokens"] = max_tokens
        if logprobs is not None:
            out["logprobs"] = logprobs
        return out


class CompletionRequest(_Generation):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        self._check_common()
        if self.echo:
            raise unsupported("echo", "echo=true is not supported: the completion never includes the prompt "
                                      "(echo must be false)")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", f"best_of={self.best_of} is not supported (only 1)")
        if self.suffix:
            raise unsupported("suffix", "suffix is not supported by this server")

    def prompts(self) -> list[str | list[int]]:
        """The prompts as text or token-id lists (one Triton stream each)."""
        p = self.prompt
        if isinstance(p, str):
            out: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            out = [list(p)]  # type: ignore[arg-type]
        else:
            out = list(p)  # type: ignore[arg-type]
        if not out:
            raise invalid("prompt must not be an empty list", "prompt")
        if len(out) > MAX_PROMPTS:
            raise invalid(f"at most {MAX_PROMPTS} prompts per request, got {len(out)}", "prompt")
        for i, one in enumerate(out):
            if not one:
                raise invalid("the prompt is empty" if len(out) == 1 else f"prompt {i} is empty", "prompt")
            if isinstance(one, list) and any(t < 0 for t in one):
                raise invalid("token ids must be non-negative", "prompt")
        return out

    def sampling(self, defaults: dict[str, Any]) -> dict[str, Any]:
        return self._sampling(self.max_tokens, self.logprobs, defaults)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; fields besides ``role`` and ``content`` (name, tool_calls, ...) reach the template as given."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None

    def template_dict(self, index: int) -> dict[str, Any]:
        """The message as the chat template sees it: text parts joined by newlines (vLLM's string format)."""
        out = self.model_dump()
        if isinstance(self.content, list):
            texts = []
            for j, part in enumerate(self.content):
                where = f"messages.{index}.content.{j}"
                if part.get("type") != "text":
                    raise unsupported(where, f"content parts of type {part.get('type')!r} are not supported: this "
                                             "model takes text only")
                try:
                    texts.append(TextPart.model_validate(part).text)
                except ValidationError as e:
                    raise _validation_error(e, where) from None
            out["content"] = "\n".join(texts)
        return out


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM extensions
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        self._check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs requires logprobs=true", "top_logprobs")
        if self.tools:
            raise unsupported("tools", "tools are not supported by this server")
        if self.tool_choice not in (None, "none"):
            raise unsupported("tool_choice", "tool_choice is not supported by this server (only \"none\")")
        fmt = (self.response_format or {}).get("type", "text")
        if fmt != "text":
            raise unsupported("response_format", f"response_format {fmt!r} is not supported (only \"text\")")

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict(i) for i, m in enumerate(self.messages)]

    def sampling(self, defaults: dict[str, Any]) -> dict[str, Any]:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, logprobs, defaults)


_ERROR_CODES = {"missing": "missing_required_parameter"}
# pydantic names the union member it tried in an error's location; what each member means to a client:
_UNION_MEMBERS = {"str": "a string", "list[str]": "a list of strings", "list[int]": "a list of token ids",
                  "list[list[int]]": "a list of token-id lists", "list[dict[str,any]]": "a list of content parts",
                  "dict[str,any]": "an object"}

R = TypeVar("R", CompletionRequest, ChatCompletionRequest)


def _validation_error(e: ValidationError, prefix: str = "") -> APIError:
    """The first problem pydantic found, as a 400 whose ``param`` is the field's dotted path."""
    errors = e.errors(include_url=False)
    err = errors[0]
    loc = list(err["loc"])
    tag = next((i for i, p in enumerate(loc) if isinstance(p, str) and p in _UNION_MEMBERS), None)
    path = ".".join(str(p) for p in ([prefix] if prefix else []) + loc[:tag if tag is not None else len(loc)])
    if tag is not None:  # a union: say which forms are accepted, not why the first one failed
        head = tuple(loc[:tag])
        kinds = dict.fromkeys(_UNION_MEMBERS[str(x["loc"][tag])] for x in errors
                              if tuple(x["loc"][:tag]) == head and len(x["loc"]) > tag
                              and str(x["loc"][tag]) in _UNION_MEMBERS)
        return invalid(f"{path}: must be {' or '.join(kinds)}", path or None, "invalid_type")
    kind = err["type"]
    code = _ERROR_CODES.get(kind, "invalid_type" if kind.endswith("_type") else "invalid_value")
    return invalid(f"{path}: {err['msg']}" if path else err["msg"], path or None, code)


def parse(body: Any, model: type[R]) -> R:
    """Validate a decoded JSON body; raises APIError (400) naming the first bad field."""
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_type")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    req.check()
    return req


__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "StreamOptions", "parse"]
