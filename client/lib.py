"""Client library for the ``hybrid_llm`` Triton model.

* gRPC (tritonclient bidirectional stream): :func:`generate_stream_grpc` returns a :class:`Generation`;
  iterate it for the text deltas as they arrive, then read ``.result`` (finish reason, ids, timings).
* HTTP (Triton's generate extension): :func:`generate_http` does the same over
  ``/v2/models/<model>/generate_stream`` (server-sent events) or ``/generate`` (one JSON reply).
* :func:`health`: server live/ready, model ready and the model's config parameters.

Every failure is a :class:`ClientError` with a message fit for a terminal: :class:`ServerUnavailable`
when nothing answers, :class:`GenerationError` when the server refused or failed the request.
"""

from __future__ import annotations

import http.client
import json
import queue
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MODEL = "hybrid_llm"
DEFAULT_GRPC_URL = "127.0.0.1:8001"
DEFAULT_HTTP_URL = "127.0.0.1:8000"


class ClientError(Exception):
    """Anything that went wrong, with a message for humans."""


class ServerUnavailable(ClientError):
    """Nothing answers at the address, or the model is not ready."""


class GenerationError(ClientError):
    """The server refused or failed this request (e.g. invalid input)."""


class GenerationTimeout(ClientError, TimeoutError):
    """No response arrived within the timeout (the request is cancelled)."""


@dataclass
class Result:
    """What a finished generation returned; times are ``time.perf_counter()`` values."""

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    t_start: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of each response carrying ids

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.t_start if self.token_times else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def _request_dict(prompt: str | None, input_ids: list[int] | None, stream: bool, max_tokens: int | None,
                  sampling: dict[str, Any] | None, exclude_input_in_output: bool | None) -> dict[str, Any]:
    if (prompt is None) == (input_ids is None):
        raise ClientError("give a prompt or input_ids (exactly one)")
    req: dict[str, Any] = {"stream": stream}
    if prompt is not None:
        req["text_input"] = prompt
    else:
        req["input_ids"] = [int(t) for t in input_ids or ()]
    if max_tokens is not None:
        req["max_tokens"] = int(max_tokens)
    if sampling:
        req["sampling_parameters"] = json.dumps(sampling)
    if exclude_input_in_output is not None:
        req["exclude_input_in_output"] = bool(exclude_input_in_output)
    return req


def grpc_inputs(request: dict[str, Any]) -> list:
    """tritonclient gRPC inputs for a request dict (keys as in the model's config.pbtxt)."""
    import tritonclient.grpc as grpcclient

    specs = {"text_input": ("BYTES", np.object_), "sampling_parameters": ("BYTES", np.object_),
             "input_ids": ("INT32", np.int32), "max_tokens": ("INT32", np.int32),
             "stream": ("BOOL", np.bool_), "exclude_input_in_output": ("BOOL", np.bool_)}
    inputs = []
    for name, value in request.items():
        dtype, np_type = specs[name]
        if np_type is np.object_:
            arr = np.array([value.encode("utf-8") if isinstance(value, str) else value], dtype=np.object_)
        else:
            arr = np.array(value if isinstance(value, list) else [value], dtype=np_type)
        inp = grpcclient.InferInput(name, list(arr.shape), dtype)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


class Generation:
    """One request's responses as an iterator of text deltas; ``result`` is complete when it ends."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.result = Result(t_start=time.perf_counter())
        self.done = False

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        raise NotImplementedError

    def _take(self, text: str, ids: list[int], finish_reason: str | None) -> None:
        if ids:
            self.result.token_times.append(time.perf_counter())
            self.result.output_ids.extend(ids)
        self.result.text += text
        if finish_reason:
            self.result.finish_reason = finish_reason

    def wait(self) -> Result:
        """Consume the rest of the responses and return the result."""
        for _ in self:
            pass
        return self.result

    def close(self) -> None:
        self.done = True

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- gRPC ---------------------------------------------------------------------------------------------

class GrpcGeneration(Generation):
    """A request on its own tritonclient gRPC stream (one client per generation keeps them independent)."""

    def __init__(self, url: str, inputs: list, model: str = MODEL, timeout: float = 60.0) -> None:
        import tritonclient.grpc as grpcclient

        super().__init__(timeout)
        self._queue: queue.Queue = queue.Queue()
        self._client = grpcclient.InferenceServerClient(url)
        self._client.start_stream(callback=lambda result, error: self._queue.put((result, error)))
        try:
            self._client.async_stream_infer(model, inputs, request_id=uuid.uuid4().hex,
                                            enable_empty_final_response=True)
        except Exception as e:  # a stream that failed at once (server down) reports through the callback
            try:
                _, error = self._queue.get(timeout=1.0)
            except queue.Empty:
                error = e
            self.close()
            raise _grpc_error(error) from None

    def __next__(self) -> str:
        while not self.done:
            try:
                result, error = self._queue.get(timeout=self.timeout)
            except queue.Empty:
                self.cancel()
                raise GenerationTimeout(f"no response within {self.timeout:.0f} s") from None
            if error is not None:
                self.close()
                raise _grpc_error(error)
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            text = result.as_numpy("text_output")
            ids = result.as_numpy("output_ids")
            reason = result.as_numpy("finish_reason")
            delta = text[0].decode("utf-8", errors="replace") if text is not None and text.size else ""
            self._take(delta, [] if ids is None else ids.tolist(),
                       reason[0].decode() if reason is not None and reason.size else None)
            if final:
                self.close()
            if delta or (ids is not None and ids.size):
                return delta
        raise StopIteration

    def cancel(self) -> None:
        """Cancel the request on the server (the stream is closed with cancel_requests=True)."""
        self._shut(cancel=True)

    def close(self) -> None:
        self._shut(cancel=False)

    def _shut(self, cancel: bool) -> None:
        self.done = True
        client, self._client = self._client, None
        if client is not None:
            client.stop_stream(cancel_requests=cancel)
            client.close()


def _grpc_error(error: Exception) -> ClientError:
    status = str(getattr(error, "status", lambda: "")() or "")
    message = getattr(error, "message", lambda: str(error))()
    if "UNAVAILABLE" in status or "failed to connect" in message.lower():
        return ServerUnavailable(f"server not reachable over gRPC: {message}")
    return GenerationError(message)


def generate_stream_grpc(url: str = DEFAULT_GRPC_URL, prompt: str | None = None, *,
                         input_ids: list[int] | None = None, max_tokens: int | None = None,
                         sampling: dict[str, Any] | None = None, stream: bool = True,
                         exclude_input_in_output: bool | None = None, model: str = MODEL,
                         timeout: float = 60.0) -> GrpcGeneration:
    """Start a generation over gRPC; iterate the returned object for text deltas (one if not streamed)."""
    req = _request_dict(prompt, input_ids, stream, max_tokens, sampling, exclude_input_in_output)
    return GrpcGeneration(url, grpc_inputs(req), model, timeout)


# ---- HTTP ---------------------------------------------------------------------------------------------

class HttpGeneration(Generation):
    """A request over Triton's generate extension (``generate_stream`` SSE, or ``generate``)."""

    def __init__(self, url: str, request: dict[str, Any], model: str = MODEL, timeout: float = 60.0) -> None:
        super().__init__(timeout)
        host, _, port = url.removeprefix("http://").partition(":")
        self._conn = http.client.HTTPConnection(host, int(port or 80), timeout=timeout)
        self.stream = bool(request.get("stream"))
        path = f"/v2/models/{model}/{'generate_stream' if self.stream else 'generate'}"
        try:
            self._conn.request("POST", path, body=json.dumps(request),
                               headers={"Content-Type": "application/json"})
            self._resp = self._conn.getresponse()
        except (ConnectionError, OSError) as e:
            self.close()
            raise ServerUnavailable(f"server not reachable over HTTP at {url}: {e}") from None
        if self._resp.status != 200:
            body = self._resp.read().decode(errors="replace")
            self.close()
            raise GenerationError(_error_text(body) or f"HTTP {self._resp.status}")

    def __next__(self) -> str:
        while not self.done:
            if self.stream:
                line = self._resp.readline()
                if not line:
                    self.close()
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
            else:
                payload = self._resp.read()
                self.close()
            obj = json.loads(payload)
            if "error" in obj:
                self.close()
                raise GenerationError(obj["error"])
            ids = obj.get("output_ids", [])
            ids = [ids] if isinstance(ids, int) else list(ids)
            text = obj.get("text_output", "")
            text = "".join(text) if isinstance(text, list) else text
            self._take(text, ids, obj.get("finish_reason") or None)
            if text or ids:
                return text
        raise StopIteration

    def close(self) -> None:
        self.done = True
        self._conn.close()


def _error_text(body: str) -> str:
    body = body.strip().removeprefix("data:").strip()  # generate_stream answers errors as an SSE event
    try:
        return str(json.loads(body).get("error", body))
    except (ValueError, AttributeError):
        return body.strip()


def generate_http(url: str = DEFAULT_HTTP_URL, prompt: str | None = None, *, input_ids: list[int] | None = None,
                  max_tokens: int | None = None, sampling: dict[str, Any] | None = None, stream: bool = True,
                  exclude_input_in_output: bool | None = None, model: str = MODEL,
                  timeout: float = 60.0) -> HttpGeneration:
    """Start a generation over HTTP; iterate the returned object for text deltas (one if not streamed)."""
    req = _request_dict(prompt, input_ids, stream, max_tokens, sampling, exclude_input_in_output)
    return HttpGeneration(url, req, model, timeout)


# ---- health -------------------------------------------------------------------------------------------

def health(url: str | None = None, protocol: str = "grpc", model: str = MODEL, timeout: float = 5.0) -> dict:
    """Server live/ready, model ready and (when ready) the model's config parameters.

    Raises :class:`ServerUnavailable` when nothing answers at ``url``.
    """
    from tritonclient.utils import InferenceServerException

    if protocol == "grpc":
        import tritonclient.grpc as grpcclient

        client: Any = grpcclient.InferenceServerClient(url or DEFAULT_GRPC_URL)
        kw: dict[str, Any] = {"client_timeout": timeout}
    else:
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(url or DEFAULT_HTTP_URL, connection_timeout=timeout,
                                                  network_timeout=timeout)
        kw = {}
    where = url or (DEFAULT_GRPC_URL if protocol == "grpc" else DEFAULT_HTTP_URL)
    try:
        try:
            out: dict[str, Any] = {"url": where, "live": client.is_server_live(**kw),
                                   "ready": client.is_server_ready(**kw)}
        except (InferenceServerException, ConnectionError, OSError) as e:
            raise ServerUnavailable(f"no Triton server answers at {where} ({protocol}): {e}") from None
        out["model_ready"] = client.is_model_ready(model, **kw)
        out["parameters"] = {}
        if out["model_ready"]:
            if protocol == "grpc":
                cfg = client.get_model_config(model, as_json=True, **kw)["config"]
            else:
                cfg = client.get_model_config(model)
            out["parameters"] = {k: v.get("string_value", v.get("stringValue", ""))
                                 for k, v in cfg.get("parameters", {}).items()}
            # gRPC's JSON form leaves out fields at their default (max_batch_size 0).
            out["max_batch_size"] = cfg.get("max_batch_size", cfg.get("maxBatchSize", 0))
        return out
    finally:
        client.close()
