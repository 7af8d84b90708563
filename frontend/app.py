"""The FastAPI application: OpenAI routes over :class:`~frontend.triton.TritonBackend`.

Routes: ``GET /health``, ``GET /v1/models``, ``GET /v1/models/{model}``, ``POST /v1/completions``,
``POST /v1/chat/completions``. Streams are server-sent events exactly as OpenAI sends them (``data: {...}``
chunks, then ``data: [DONE]``). A streamed request waits for its first piece before the response starts,
so a request the server refuses still gets its own status (400, 404, 503) rather than a 200 stream that
carries an error; an error after that is one ``data: {"error": ...}`` event before ``[DONE]``.

A client that goes away cancels its Triton streams: while a streamed response runs, Starlette cancels
the response task; before that (and for non-streamed requests) a watcher on the ASGI ``receive`` channel
does. Every error leaves as an OpenAI error object (:mod:`frontend.errors`), never as a stack trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .chat import TemplateRenderError
from .errors import APIError, internal, invalid, unavailable
from .protocol import ChatCompletionRequest, CompletionRequest, parse
from .responses import ChatFormat, Choice, CompletionFormat
from .triton import ModelInfo, Piece, TritonBackend

log = logging.getLogger("frontend")
T = TypeVar("T")
MAX_BODY_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class Settings:
    """How the frontend reaches Triton and finds the bundles (``python -m frontend --help``)."""

    triton_url: str = "127.0.0.1:8001"
    model_repository: Path | None = None
    bundles: dict[str, Path] = field(default_factory=dict)
    cache_ttl_s: float = 10.0
    request_timeout_s: float | None = None
    owned_by: str = "hybrid-llm-serving"


class ClientGone(Exception):
    """The HTTP client disconnected before its response started."""


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _sse(obj: Any) -> bytes:
    return f"data: {_dumps(obj)}\n\n".encode()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, aw: Awaitable[T]) -> T:
    """Await ``aw``; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is shutting down: let ``aw`` clean up before we go
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientGone


async def _merge(backend: TritonBackend, model: str, prompts: list[str | list[int]], sampling: dict[str, Any],
                 request_id: str) -> AsyncIterator[tuple[int, Piece]]:
    """The pieces of every prompt's generation, as ``(choice index, piece)``, in arrival order."""
    if len(prompts) == 1:
        async with aclosing(backend.generate(model, prompts[0], sampling, request_id)) as gen:
            async for piece in gen:
                yield 0, piece
        return
    queue: asyncio.Queue[tuple[int, Piece | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, prompt: str | list[int]) -> None:
        try:
            async with aclosing(backend.generate(model, prompt, sampling, f"{request_id}-{i}")) as gen:
                async for piece in gen:
                    await queue.put((i, piece, None))
        except Exception as e:
            await queue.put((i, None, e))

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
    try:
        remaining = len(tasks)
        while remaining:
            i, piece, error = await queue.get()
            if error is not None:
                raise error
            assert piece is not None
            yield i, piece
            remaining -= piece.final
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def create_app(settings: Settings) -> FastAPI:
    """The ASGI application (its TritonBackend is created at startup, inside uvicorn's event loop)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.backend = TritonBackend(settings.triton_url, model_repository=settings.model_repository,
                                          bundles=settings.bundles, cache_ttl_s=settings.cache_ttl_s,
                                          request_timeout_s=settings.request_timeout_s)
        log.info("OpenAI frontend for Triton at %s (gRPC)", settings.triton_url)
        try:
            yield
        finally:
            await app.state.backend.close()

    app = FastAPI(title="Hybrid LLM OpenAI-compatible frontend", lifespan=lifespan, openapi_url=None)

    def backend(request: Request) -> TritonBackend:
        return request.app.state.backend

    @app.exception_handler(APIError)
    async def api_error(_request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        message = f"Invalid URL ({request.method} {request.url.path})" if e.status_code in (404, 405) else str(e.detail)
        return JSONResponse(APIError(e.status_code, message).body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def route_error(_request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(invalid(str(e.errors()[0].get("msg", e))).body(), status_code=400)

    @app.exception_handler(Exception)
    async def crash(request: Request, e: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(internal(f"internal error: {type(e).__name__}: {e}").body(), status_code=500)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        ok, why = await backend(request).ready()
        if not ok:
            raise unavailable(why)
        return JSONResponse({"status": "ok", "triton": settings.triton_url})

    def card(m: ModelInfo) -> dict[str, Any]:
        out: dict[str, Any] = {"id": m.name, "object": "model", "created": m.created, "owned_by": settings.owned_by}
        if m.max_model_len is not None:
            out["max_model_len"] = m.max_model_len
        return out

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card(m) for m in await backend(request).models()]})

    @app.get("/v1/models/{model}")
    async def one_model(request: Request, model: str) -> JSONResponse:
        return JSONResponse(card(await backend(request).model(model)))

    async def body(request: Request) -> Any:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        try:
            return json.loads(raw)
        except ValueError as e:
            raise invalid(f"the request body is not valid JSON: {e}", code="invalid_json") from None

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse(await body(request), CompletionRequest)
        be = backend(request)
        info = await be.model(req.model)
        if req.logprobs is not None and not info.has_logprobs:
            raise invalid(f"the model `{info.name}` does not return logprobs", "logprobs", "unsupported_value")
        prompts = req.prompts()
        rid = f"cmpl-{uuid.uuid4().hex}"
        fmt = CompletionFormat(rid, info.name, int(time.time()), req.logprobs is not None, req.include_usage)
        return await respond(request, bool(req.stream), fmt, len(prompts),
                             _merge(be, info.name, prompts, req.sampling(info.defaults), rid))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse(await body(request), ChatCompletionRequest)
        be = backend(request)
        info = await be.model(req.model)
        if info.chat_template is None:
            raise invalid(info.chat_problem, "messages", "chat_template_missing")
        if req.logprobs and not info.has_logprobs:
            raise invalid(f"the model `{info.name}` does not return logprobs", "logprobs", "unsupported_value")
        try:
            prompt = info.chat_template.render(req.template_messages(), add_generation_prompt=req.add_generation_prompt,
                                               template_kwargs=req.chat_template_kwargs)
            prompt = info.chat_template.for_server(prompt)
        except TemplateRenderError as e:
            raise invalid(str(e), "messages") from None
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        fmt = ChatFormat(rid, info.name, int(time.time()), bool(req.logprobs), req.include_usage)
        return await respond(request, bool(req.stream), fmt, 1,
                             _merge(be, info.name, [prompt], req.sampling(info.defaults), rid))

    async def respond(request: Request, stream: bool, fmt: CompletionFormat | ChatFormat, n: int,
                      pieces: AsyncIterator[tuple[int, Piece]]) -> Response:
        choices = [Choice(i) for i in range(n)]
        try:
            if not stream:
                async def collect() -> None:
                    async with aclosing(pieces) as it:
                        async for i, piece in it:
                            choices[i].add(piece)

                await _unless_gone(request, collect())
                return JSONResponse(fmt.response(choices))
            first = await _unless_gone(request, anext(pieces))
        except ClientGone:
            log.info("%s: the client went away before the response started; its requests are cancelled", fmt.id)
            return Response(status_code=499)
        except BaseException:
            await pieces.aclose()
            raise
        return StreamingResponse(events(fmt, choices, first, pieces), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def events(fmt: CompletionFormat | ChatFormat, choices: list[Choice], first: tuple[int, Piece],
                     pieces: AsyncIterator[tuple[int, Piece]]) -> AsyncIterator[bytes]:
        async with aclosing(pieces) as it:
            try:
                for chunk in fmt.start(choices):
                    yield _sse(chunk)
                item: tuple[int, Piece] | None = first
                while item is not None:
                    for chunk in fmt.on_piece(choices[item[0]], item[1]):
                        yield _sse(chunk)
                    item = await anext(it, None)
                if fmt.include_usage:
                    yield _sse(fmt.usage_chunk(choices))
            except APIError as e:
                log.warning("%s failed mid-stream: %s", fmt.id, e)
                yield _sse(e.body())
            except asyncio.CancelledError:
                log.info("%s: the client disconnected mid-stream; its Triton streams are cancelled", fmt.id)
                raise
            yield b"data: [DONE]\n\n"

    return app
