"""The frontend's only link to Triton: tritonclient's asyncio gRPC client.

* :class:`TritonBackend.model` / :meth:`~TritonBackend.models` — which models follow this repository's LLM
  convention (decoupled; ``text_input`` / ``stream`` / ``sampling_parameters`` -> ``text_output``,
  ``output_ids``, ``finish_reason``, ``num_input_tokens``), each with its bundle's chat template and
  sampling defaults (:class:`ModelInfo`, cached for ``cache_ttl_s``: the frontend keeps no other state).
* :meth:`TritonBackend.generate` — one request on its own bidirectional stream, as :class:`Piece` objects.
  A refused request comes back as an error inside the stream, whose message starts with the model's
  error code (``[INVALID_ARG] ...``, see ``deploy.triton_adapter.triton_error``): INVALID_ARG -> 400,
  UNAVAILABLE -> 503, others -> 500. (Triton's ``triton_grpc_error`` header would turn such errors into
  gRPC statuses, but with it Triton 2.51 crashes once streams have been cancelled; deploy/README.md.)
  Leaving the iterator before the final response (client gone, task cancelled) cancels the Triton
  request, which frees its state slot and KV pages; after the final response or an error the stream is
  read to its end and never cancelled (cancelling a finished request trips another Triton 2.51 bug).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from .chat import ChatTemplate, ChatTemplateError
from .errors import APIError, from_grpc_status, internal, model_not_found, unavailable

log = logging.getLogger("frontend.triton")

REQUIRED_INPUTS = ("text_input", "stream", "sampling_parameters", "exclude_input_in_output")
REQUIRED_OUTPUTS = ("text_output", "output_ids", "finish_reason", "num_input_tokens")
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k")  # read from the bundle's generation_config.json
OPENAI_TEMPERATURE = 1.0  # OpenAI's default when neither the request nor the bundle gives one
MAX_MESSAGE_BYTES = 2**31 - 1  # tritonclient's default message size limits


def channel_args() -> list[tuple[str, int]]:
    """tritonclient's default channel options, plus a short reconnect backoff: after Triton restarts (or
    starts after the frontend) requests succeed again within ~2 s rather than after gRPC's default
    backoff of up to two minutes."""
    ka = grpcaio.KeepAliveOptions()
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", ka.keepalive_time_ms), ("grpc.keepalive_timeout_ms", ka.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", int(ka.keepalive_permit_without_calls)),
            ("grpc.http2.max_pings_without_data", ka.http2_max_pings_without_data),
            ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 2000)]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the frontend knows about one served model."""

    name: str
    created: int
    bundle_dir: Path | None
    chat_template: ChatTemplate | None
    chat_problem: str  # why chat is unavailable ("" when chat_template is set)
    defaults: dict[str, Any] = field(default_factory=dict)  # sampling defaults (temperature, top_p, top_k)
    max_model_len: int | None = None
    has_logprobs: bool = False  # the model has the output_logprobs output


@dataclass(slots=True)
class Piece:
    """One Triton response of a generation: a text delta and the ids (and logprobs) it carries."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[str, Any]] | None
    final: bool
    finish_reason: str | None = None
    num_input_tokens: int | None = None


def _param(cfg: Mapping[str, Any], key: str) -> str:
    value = (cfg.get("parameters") or {}).get(key) or {}
    return str(value.get("string_value", ""))


def follows_convention(cfg: Mapping[str, Any]) -> bool:
    """Whether a Triton model config (JSON form) is an LLM of this repository's convention."""
    inputs = {i.get("name") for i in cfg.get("input") or ()}
    outputs = {o.get("name") for o in cfg.get("output") or ()}
    decoupled = bool((cfg.get("model_transaction_policy") or {}).get("decoupled"))
    return decoupled and set(REQUIRED_INPUTS) <= inputs and set(REQUIRED_OUTPUTS) <= outputs


def _tensor(name: str, value: Any, dtype: str) -> grpcaio.InferInput:
    if dtype == "BYTES":
        arr = np.array([value.encode("utf-8")], dtype=np.object_)
    elif dtype == "INT32":
        arr = np.asarray(value, dtype=np.int32)
    else:
        arr = np.array([value], dtype=np.bool_)
    t = grpcaio.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def request_inputs(prompt: str | list[int], sampling: Mapping[str, Any]) -> list[grpcaio.InferInput]:
    """The Triton inputs of one generation: streamed, prompt excluded from the output."""
    first = _tensor("text_input", prompt, "BYTES") if isinstance(prompt, str) else _tensor("input_ids", prompt, "INT32")
    return [first, _tensor("stream", True, "BOOL"), _tensor("exclude_input_in_output", True, "BOOL"),
            _tensor("sampling_parameters", json.dumps(dict(sampling)), "BYTES")]


def parse_piece(result: Any) -> Piece:
    """A tritonclient InferResult of this repository's model -> Piece."""
    final = bool(result.get_response().parameters["triton_final_response"].bool_param)
    text = result.as_numpy("text_output")
    ids = result.as_numpy("output_ids")
    reason = result.as_numpy("finish_reason")
    lps = result.as_numpy("output_logprobs")
    n_in = result.as_numpy("num_input_tokens")
    return Piece(text=bytes(text[0]).decode("utf-8") if text is not None and text.size else "",
                 token_ids=[] if ids is None else [int(i) for i in ids.reshape(-1)],
                 logprobs=None if lps is None or not lps.size else json.loads(bytes(lps.reshape(-1)[0])),
                 final=final, finish_reason=bytes(reason[0]).decode() if reason is not None and reason.size else None,
                 num_input_tokens=int(n_in.reshape(-1)[0]) if n_in is not None and n_in.size else None)


_CODED = re.compile(r"^\[([A-Z_]+)\] (.*)$", re.DOTALL)
# The model's error codes (TritonError names) -> gRPC status names for from_grpc_status.
_MODEL_CODES = {"INVALID_ARG": "INVALID_ARGUMENT", "UNSUPPORTED": "INVALID_ARGUMENT", "NOT_FOUND": "NOT_FOUND",
                "UNAVAILABLE": "UNAVAILABLE", "CANCELLED": "CANCELLED", "INTERNAL": "INTERNAL"}


def stream_error(message: str, where: str) -> APIError:
    """An error reported inside a stream: the model's ``[CODE] message``, or one of Triton's own."""
    m = _CODED.match(message)
    if m is not None:
        return from_grpc_status(_MODEL_CODES.get(m.group(1), "INTERNAL"), m.group(2), where)
    low = message.lower()
    if "unknown model" in low or "is not found" in low:
        return APIError(404, message, code="model_not_found", param="model")
    if "not ready" in low or "unavailable" in low:
        return unavailable(message)
    return internal(message)


class TritonBackend:
    """Talks to one tritonserver over gRPC (create it inside the running event loop)."""

    def __init__(self, url: str, *, model_repository: Path | None = None,
                 bundles: Mapping[str, Path] | None = None, cache_ttl_s: float = 10.0,
                 request_timeout_s: float | None = None) -> None:
        self.url = url
        self.model_repository = model_repository
        self.bundles = dict(bundles or {})
        self.cache_ttl_s = cache_ttl_s
        self.request_timeout_s = request_timeout_s
        self.client = grpcaio.InferenceServerClient(url, channel_args=channel_args())
        self._cache: dict[str, tuple[float, ModelInfo]] = {}
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        await self.client.close()

    # ---- status --------------------------------------------------------------------------------
    async def ready(self, timeout_s: float = 5.0) -> tuple[bool, str]:
        """Whether Triton answers and is ready, with a message when it is not."""
        try:
            ok = await self.client.is_server_ready(client_timeout=timeout_s)
        except InferenceServerException as e:
            return False, f"the Triton server at {self.url} is not reachable: {e.message()}"
        return bool(ok), "" if ok else f"the Triton server at {self.url} is not ready"

    async def _index(self) -> list[dict[str, Any]]:
        try:
            index = await self.client.get_model_repository_index(as_json=True)
        except InferenceServerException as e:
            raise self._error(e) from None
        return list(index.get("models") or ())

    def _error(self, e: InferenceServerException) -> APIError:
        code = str(e.status() or "").removeprefix("StatusCode.")
        return from_grpc_status(code or "UNKNOWN", e.message() or str(e), self.url)

    # ---- models --------------------------------------------------------------------------------
    async def models(self) -> list[ModelInfo]:
        """Every ready model of this repository's convention."""
        out = []
        for entry in await self._index():
            if entry.get("state") != "READY":
                continue
            try:
                out.append(await self.model(str(entry["name"])))
            except APIError as e:
                if e.status != 404:
                    raise
        return sorted({m.name: m for m in out}.values(), key=lambda m: m.name)

    async def model(self, name: str) -> ModelInfo:
        """The served model ``name``; APIError 404 when Triton has no such LLM, 503 when it is not ready."""
        hit = self._cache.get(name)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        async with self._lock:
            hit = self._cache.get(name)
            if hit is not None and hit[0] > time.monotonic():
                return hit[1]
            info = await self._load(name)
            self._cache[name] = (time.monotonic() + self.cache_ttl_s, info)
            return info

    def forget(self, name: str) -> None:
        """Drop a cached model (after Triton said it is gone or not ready)."""
        self._cache.pop(name, None)

    async def _load(self, name: str) -> ModelInfo:
        versions = [e for e in await self._index() if e.get("name") == name]
        if not versions:
            raise model_not_found(name)
        if not any(e.get("state") == "READY" for e in versions):
            e = versions[0]
            raise unavailable(f"the model `{name}` is not ready ({e.get('state')}: {e.get('reason') or 'loading'})")
        try:
            cfg = (await self.client.get_model_config(name, as_json=True))["config"]
        except InferenceServerException as e:
            raise self._error(e) from None
        if not follows_convention(cfg):
            raise model_not_found(name, " as an LLM: it does not follow this server's convention (decoupled, "
                                        "text_input/stream/sampling_parameters -> text_output, output_ids, "
                                        "finish_reason, num_input_tokens)")
        bundle = self._bundle_dir(name, _param(cfg, "engine_dir"))
        template, problem = None, ""
        defaults: dict[str, Any] = {"temperature": OPENAI_TEMPERATURE}
        max_len = None
        if bundle is None:
            problem = (f"the frontend cannot find the bundle of `{name}` (engine_dir "
                       f"{_param(cfg, 'engine_dir')!r}); start it with --bundle {name}=DIR")
        else:
            try:
                template = ChatTemplate.from_dir(bundle)
            except ChatTemplateError as e:
                log.error("model %s: %s", name, e)
                problem = str(e)
            if template is None and not problem:
                problem = (f"the model `{name}` has no chat template (no chat_template.jinja and no chat_template "
                           f"in tokenizer_config.json in {bundle}); use /v1/completions, or add a template to "
                           f"the checkpoint and rebuild the bundle")
            defaults.update(_generation_defaults(bundle))
            max_len = _max_model_len(bundle)
        outputs = {o.get("name") for o in cfg.get("output") or ()}
        log.info("model %s: bundle %s, chat template %s", name, bundle,
                 template.origin if template is not None else f"none ({problem})")
        return ModelInfo(name=name, created=int(time.time()), bundle_dir=bundle, chat_template=template,
                         chat_problem=problem, defaults=defaults, max_model_len=max_len,
                         has_logprobs="output_logprobs" in outputs)

    def _bundle_dir(self, name: str, engine_dir: str) -> Path | None:
        candidates = []
        if name in self.bundles:
            candidates.append(Path(self.bundles[name]))
        elif engine_dir:
            p = Path(engine_dir).expanduser()
            if p.is_absolute():
                candidates.append(p)
            elif self.model_repository is not None:
                candidates.append((self.model_repository / name / p).resolve())
        return next((c for c in candidates if (c / "tokenizer.json").is_file()), None)

    # ---- generation ----------------------------------------------------------------------------
    async def generate(self, model: str, prompt: str | list[int], sampling: Mapping[str, Any],
                       request_id: str) -> AsyncIterator[Piece]:
        """Stream one generation; raises APIError for anything Triton or the model refused or failed."""
        request = {"model_name": model, "inputs": request_inputs(prompt, sampling), "request_id": request_id}

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield request  # then half-close: Triton keeps the stream open until the final response

        call = self.client.stream_infer(one_request(), stream_timeout=self.request_timeout_s)
        finished = False
        try:
            async for result, error in call:
                if error is not None:  # the request's final response: read the stream to its end, then raise
                    finished = True
                    await self._drain(call, request_id)
                    text = error.message() if isinstance(error, InferenceServerException) else str(error)
                    api_error = stream_error(text or "the server failed the request", self.url)
                    if api_error.status in (404, 503):
                        self.forget(model)
                    raise api_error
                piece = parse_piece(result)
                if piece.final:
                    finished = True
                    await self._drain(call, request_id)
                    if piece.finish_reason == "cancelled":
                        raise unavailable("the server cancelled the request (the model is being unloaded or the "
                                          "server is shutting down)")
                    yield piece
                    return
                yield piece
            finished = True
            raise internal(f"the Triton stream of request {request_id} ended without a final response")
        except grpc.aio.AioRpcError as e:
            finished = True
            if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                self.forget(model)
            raise from_grpc_status(e.code().name, e.details() or "", self.url) from None
        finally:
            if not finished:  # the caller left mid-stream: cancel the Triton request (slot and pages freed)
                call.cancel()


    @staticmethod
    async def _drain(call: Any, request_id: str, timeout_s: float = 10.0) -> None:
        """Read a stream whose request is finished to its end (Triton closes it right after the final
        response), so that the call completes instead of being cancelled when it is dropped."""

        async def rest() -> None:
            async for _ in call:
                pass

        try:
            await asyncio.wait_for(rest(), timeout_s)
        except TimeoutError:
            log.warning("the Triton stream of %s stayed open %.0f s after its final response", request_id, timeout_s)


def _generation_defaults(bundle: Path) -> dict[str, Any]:
    """Sampling defaults of the checkpoint's generation_config.json (as vLLM applies them)."""
    try:
        cfg = json.loads((bundle / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(cfg, dict):
        return {}
    # do_sample is ignored, as vLLM ignores it: configs leave it at false while they set a temperature.
    return {k: cfg[k] for k in SAMPLING_DEFAULT_KEYS
            if isinstance(cfg.get(k), int | float) and not isinstance(cfg.get(k), bool)}


def _max_model_len(bundle: Path) -> int | None:
    try:
        return int(json.loads((bundle / "manifest.json").read_text())["limits"]["max_seq_len"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
