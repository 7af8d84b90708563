"""The OpenAI-compatible frontend (``python -m frontend``) in front of a real tritonserver.

Driven with the real ``openai`` client and with raw HTTP (server-sent events parsed by hand): both
routes streamed and not, usage from the server's counts, stop strings, seeds, logprobs, max_tokens,
16 concurrent streams, client disconnects (slots and KV pages back to 0 on Triton's metrics endpoint),
and every error with its status and type. The server serves two models: ``hybrid_llm`` (the default
bundle, with its ChatML template) and ``plain_llm`` (a bundle without a chat template).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import shutil
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from builder.bundle import BuildOptions, build_bundle
from deploy.triton import MODEL_REPOSITORY, TritonServer
from frontend.process import FrontendProcess, free_port
from hybrid_runtime.sampling import SamplingParams
from hybrid_runtime.serving import GenerationRequest, RuntimeOptions, ServingEngine, generate
from hybrid_runtime.tokenizer import Tokenizer

pytestmark = pytest.mark.integration

M = "hybrid_llm"
PROMPT = "The quick brown fox jumps over the lazy dog."
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


# ---- servers -----------------------------------------------------------------------------------------

def write_repository(dest: Path, models: dict[str, Path]) -> Path:
    """A model repository with one copy of hybrid_llm per entry, each serving its own bundle."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    for name, bundle in models.items():
        d = dest / name
        shutil.copytree(MODEL_REPOSITORY / "hybrid_llm", d, ignore=shutil.ignore_patterns("__pycache__"))
        cfg = text_format.Parse((d / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        cfg.name = name
        cfg.parameters["engine_dir"].string_value = str(bundle)
        (d / "config.pbtxt").write_text(text_format.MessageToString(cfg))
    return dest


@pytest.fixture(scope="module")
def plain_bundle(default_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model without a chat template."""
    ckpt = tmp_path_factory.mktemp("plain") / "ckpt"
    shutil.copytree(default_checkpoint, ckpt)
    (ckpt / "chat_template.jinja").unlink()
    out = ckpt.parent / "bundle"
    build_bundle(ckpt, out, BuildOptions(max_batch_size=2, max_input_len=128, max_seq_len=256, max_num_tokens=128),
                 progress=lambda _m: None)
    return out


@pytest.fixture(scope="module")
def server(default_bundle: Path, plain_bundle: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    tmp = tmp_path_factory.mktemp("frontend_triton")
    repo = write_repository(tmp / "repo", {M: default_bundle, "plain_llm": plain_bundle})
    s = TritonServer(repo, model=M, exit_timeout_s=3, log_path=tmp / "tritonserver.log").start()
    try:
        s.wait("ready", timeout=120)
        yield s
    finally:
        code = s.stop()
        tail = s.log_tail(30)
        s.cleanup()
    assert not s.leaked_shm, tail
    assert code == 0, tail


@pytest.fixture(scope="module")
def frontend(server: TritonServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontendProcess]:
    fe = FrontendProcess(server.grpc_url, log_path=tmp_path_factory.mktemp("frontend") / "frontend.log")
    fe.start()
    try:
        fe.wait(60)
        yield fe
    finally:
        code = fe.stop()
        log = fe.log_text()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


@pytest.fixture(scope="module")
def client(frontend: FrontendProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(default_bundle: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_bundle)


def metric(server: TritonServer, name: str, model: str = M, **labels: str) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if m and {"model": model, **labels}.items() <= dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or "")).items():
            total += float(m.group(2))
    return total


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def idle(server: TritonServer) -> bool:
    return (metric(server, "hybrid_llm_slots_in_use") == 0 and metric(server, "hybrid_llm_kv_pages_in_use") == 0
            and metric(server, "hybrid_llm_requests_running") == 0)


# ---- raw HTTP ----------------------------------------------------------------------------------------

def post(fe: FrontendProcess, path: str, body: Any, method: str = "POST") -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", fe.port, timeout=120)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request(method, path, body=data if method == "POST" else None,
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def sse_events(raw: bytes) -> list[Any]:
    """Server-sent events parsed by hand: every event is one ``data: ...`` line and a blank line."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), text[-200:]
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events[:3]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


# ---- models, health ----------------------------------------------------------------------------------

def test_models_and_health(client: openai.OpenAI, frontend: FrontendProcess) -> None:
    models = client.models.list()
    assert sorted(m.id for m in models.data) == [M, "plain_llm"]
    assert all(m.object == "model" and m.owned_by for m in models.data)
    assert client.models.retrieve(M).id == M
    status, _, body = post(frontend, "/health", None, method="GET")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, _, body = post(frontend, "/v1/models", None, method="GET")
    assert status == 200 and {m["id"]: m["max_model_len"] for m in json.loads(body)["data"]} == {
        M: 512, "plain_llm": 256}


# ---- completions and chat through the openai client --------------------------------------------------

def test_completions_stream_and_not(client: openai.OpenAI, server: TritonServer, tok: Tokenizer) -> None:
    whole = client.completions.create(model=M, prompt=PROMPT, max_tokens=12, **GREEDY)
    c = whole.choices[0]
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-") and whole.model == M
    assert c.finish_reason == "length" and c.text and c.logprobs is None
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens == len(tok.encode(PROMPT))
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    # The same text as Triton's own endpoint gives for the same request.
    from client.lib import generate_stream_grpc

    direct = generate_stream_grpc(server.grpc_url, PROMPT, max_tokens=12, sampling={"temperature": 0,
                                                                                   "ignore_eos": True}).wait()
    assert c.text == direct.text

    chunks = list(client.completions.create(model=M, prompt=PROMPT, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(ch.usage is None for ch in chunks[:-1])
    assert "".join(ch.choices[0].text for ch in chunks[:-1]) == c.text
    assert [ch.choices[0].finish_reason for ch in chunks[:-1]].count("length") == 1
    assert chunks[-2].choices[0].finish_reason == "length"
    assert len(chunks) >= 12  # streamed: about one chunk per token
    plain = list(client.completions.create(model=M, prompt=PROMPT, max_tokens=3, stream=True, **GREEDY))
    assert all(ch.usage is None for ch in plain)  # no include_usage: no usage chunk


def test_chat_stream_and_not(client: openai.OpenAI, default_checkpoint: Path, tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    rendered = transformers.AutoTokenizer.from_pretrained(default_checkpoint).apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True)
    ref = client.completions.create(model=M, prompt=rendered, max_tokens=10, **GREEDY)
    whole = client.chat.completions.create(model=M, messages=CHAT, max_completion_tokens=10, **GREEDY)
    c = whole.choices[0]
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert c.message.role == "assistant" and c.finish_reason == "length"
    # The messages were rendered exactly as transformers renders them: same prompt, same tokens.
    assert c.message.content == ref.choices[0].text
    assert whole.usage.prompt_tokens == len(tok.encode(rendered)) and whole.usage.completion_tokens == 10
    old_name = client.chat.completions.create(model=M, messages=CHAT, max_tokens=10, **GREEDY)
    assert old_name.choices[0].message.content == c.message.content  # max_tokens, the deprecated spelling

    chunks = list(client.chat.completions.create(model=M, messages=CHAT, max_completion_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1]) == c.message.content
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-2].choices[0].delta.content is None
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert {ch.object for ch in chunks} == {"chat.completion.chunk"} and len({ch.id for ch in chunks}) == 1


def test_max_tokens_and_default(client: openai.OpenAI) -> None:
    for n in (1, 5):
        r = client.completions.create(model=M, prompt=PROMPT, max_tokens=n, **GREEDY)
        assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model=M, messages=CHAT, max_completion_tokens=3, **GREEDY)
    assert r.usage.completion_tokens == 3
    # No max_tokens: the model's default_max_tokens (16 in config.pbtxt) applies.
    assert client.completions.create(model=M, prompt=PROMPT, **GREEDY).usage.completion_tokens == 16


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(client: openai.OpenAI, stream: bool) -> None:
    ref = client.completions.create(model=M, prompt=PROMPT, max_tokens=24, **GREEDY).choices[0].text
    stop = ref[8:11]
    assert stop.strip(), ref
    expect = ref[:ref.find(stop)]

    def text_and_reason(**kw: Any) -> tuple[str, str, int]:
        if not stream:
            r = client.completions.create(model=M, prompt=PROMPT, max_tokens=24, **GREEDY, **kw)
            return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
        chunks = list(client.completions.create(model=M, prompt=PROMPT, max_tokens=24, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY, **kw))
        return ("".join(ch.choices[0].text for ch in chunks[:-1]), chunks[-2].choices[0].finish_reason,
                chunks[-1].usage.completion_tokens)

    text, reason, used = text_and_reason(stop=stop)
    assert (text, reason) == (expect, "stop") and 0 < used < 24
    text, reason, _ = text_and_reason(stop=["never appears here", stop])
    assert (text, reason) == (expect, "stop")
    chat_ref = client.chat.completions.create(model=M, messages=CHAT, max_completion_tokens=24,
                                              **GREEDY).choices[0].message.content
    chat_stop = chat_ref[6:9]
    chat = client.chat.completions.create(model=M, messages=CHAT, max_completion_tokens=24, stop=chat_stop, **GREEDY)
    assert chat.choices[0].message.content == chat_ref[:chat_ref.find(chat_stop)]
    assert chat.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def completion(seed: int) -> str:
        return client.completions.create(model=M, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    def chat(seed: int, stream: bool) -> str:
        kw: dict[str, Any] = {"model": M, "messages": CHAT, "max_completion_tokens": 16, "temperature": 0.9,
                              "top_p": 0.95, "seed": seed, "extra_body": {"ignore_eos": True, "top_k": 50}}
        if stream:
            chunks = client.chat.completions.create(stream=True, **kw)
            return "".join(ch.choices[0].delta.content or "" for ch in chunks)
        return client.chat.completions.create(**kw).choices[0].message.content

    assert completion(7) == completion(7) != completion(8)
    assert chat(7, False) == chat(7, True) == chat(7, False) != chat(8, False)
    greedy = client.completions.create(model=M, prompt=PROMPT, max_tokens=16, **GREEDY).choices[0].text
    assert completion(7) != greedy  # the default (and this) temperature samples


def test_logprobs(client: openai.OpenAI, default_bundle: Path) -> None:
    r = client.completions.create(model=M, prompt=PROMPT, max_tokens=8, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 3 <= len(top) <= 4 and top[token] == value
        assert value == max(top.values())  # greedy: the sampled token is the most likely
        assert sum(np.exp(list(top.values()))) <= 1 + 1e-9
    # The same values as the runtime computes offline for the same request.
    engine = ServingEngine(default_bundle, RuntimeOptions()).start()
    try:
        offline = generate(engine, [GenerationRequest("x", prompt=PROMPT, params=SamplingParams(
            max_tokens=8, ignore_eos=True, logprobs=3))])[0]
    finally:
        engine.shutdown()
    assert lp.token_logprobs == pytest.approx([x.logprob for x in offline.logprobs], abs=1e-4)

    kw: dict[str, Any] = {"model": M, "messages": CHAT, "max_completion_tokens": 8, "logprobs": True,
                          "top_logprobs": 2, **GREEDY}
    chat = client.chat.completions.create(**kw)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 8
    text = b"".join(bytes(t.bytes) for t in content).decode("utf-8", errors="replace")
    assert text == chat.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
    streamed = [x for ch in client.chat.completions.create(stream=True, **kw) if ch.choices and ch.choices[0].logprobs
                for x in ch.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-6)
    only_sampled = client.chat.completions.create(**{**kw, "top_logprobs": 0})
    assert all(t.top_logprobs == [] for t in only_sampled.choices[0].logprobs.content)
    plain = client.chat.completions.create(model=M, messages=CHAT, max_completion_tokens=2, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_several_prompts_in_one_completion(client: openai.OpenAI) -> None:
    prompts = [PROMPT, "Serving hybrid models", "A third prompt"]
    solo = [client.completions.create(model=M, prompt=p, max_tokens=6, **GREEDY) for p in prompts]
    ids = [[5, 17, 300], [9, 8, 7, 6]]
    by_ids = client.completions.create(model=M, prompt=ids, max_tokens=6, **GREEDY)
    assert by_ids.usage.prompt_tokens == 7 and [c.index for c in by_ids.choices] == [0, 1]
    together = client.completions.create(model=M, prompt=prompts, max_tokens=6, **GREEDY)
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.text for c in together.choices] == [s.choices[0].text for s in solo]
    assert together.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in solo)
    assert together.usage.completion_tokens == 18
    chunks = list(client.completions.create(model=M, prompt=prompts, max_tokens=6, stream=True, **GREEDY))
    for i, s in enumerate(solo):
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices[0].index == i) == s.choices[0].text


# ---- raw HTTP, SSE by hand ----------------------------------------------------------------------------

def test_raw_http_and_sse(frontend: FrontendProcess, client: openai.OpenAI) -> None:
    body = {"model": M, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    status, headers, raw = post(frontend, "/v1/completions", body)
    assert status == 200 and headers["content-type"].startswith("application/json")
    whole = json.loads(raw)
    status, headers, raw = post(frontend, "/v1/completions", {**body, "stream": True,
                                                              "stream_options": {"include_usage": True}})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == whole["choices"][0]["text"]
    assert events[-1]["usage"] == whole["usage"] and events[-1]["choices"] == []
    assert all(e["id"] == events[0]["id"] and e["object"] == "text_completion" for e in events)

    chat = {"model": M, "messages": CHAT, "max_completion_tokens": 6, "temperature": 0, "ignore_eos": True}
    status, _, raw = post(frontend, "/v1/chat/completions", chat)
    whole = json.loads(raw)
    assert status == 200 and whole["choices"][0]["message"]["role"] == "assistant"
    status, headers, raw = post(frontend, "/v1/chat/completions", {**chat, "stream": True, "logprobs": True})
    events = sse_events(raw)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == \
        whole["choices"][0]["message"]["content"]
    assert events[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert sum(len(e["choices"][0]["logprobs"]["content"]) for e in events[1:-1]) == 6
    assert all("usage" not in e for e in events)


# ---- concurrency and disconnects ----------------------------------------------------------------------

def test_16_concurrent_streams_complete_with_the_right_usage(frontend: FrontendProcess, server: TritonServer,
                                                             tok: Tokenizer) -> None:
    prompts = [f"Request {i}: {PROMPT} {'and again ' * (i % 4)}".strip() for i in range(16)]
    client = openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(i: int) -> tuple[str, dict[str, int], str | None]:
        kw: dict[str, Any] = {"model": M, "max_tokens": 6 + i, "stream": True,
                              "stream_options": {"include_usage": True}, **GREEDY}
        if i % 2:
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompts[i]}], **kw)
        else:
            stream = await client.completions.create(prompt=prompts[i], **kw)
        text, reason, use = [], None, {}
        async for ch in stream:
            if ch.usage is not None:
                use = ch.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})
            for c in ch.choices:
                text.append(c.text if i % 2 == 0 else c.delta.content or "")
                reason = c.finish_reason or reason
        return "".join(text), use, reason

    async def run_all() -> list[tuple[str, dict[str, int], str | None]]:
        try:
            return await asyncio.gather(*(one(i) for i in range(16)))
        finally:
            await client.close()

    steps_before = metric(server, "hybrid_llm_engine_steps_total", phase="decode")
    results = asyncio.run(run_all())
    for i, (_, use, reason) in enumerate(results):
        assert reason == "length" and use["completion_tokens"] == 6 + i, (i, use)
        assert use["total_tokens"] == use["prompt_tokens"] + use["completion_tokens"]
        if i % 2 == 0:
            assert use["prompt_tokens"] == len(tok.encode(prompts[i]))
    solo = client_sync(frontend).completions.create(model=M, prompt=prompts[0], max_tokens=6, **GREEDY)
    assert results[0][0] == solo.choices[0].text  # batched with 15 others, the same greedy text
    wait_for(lambda: idle(server), 15, "the batch to drain")
    time.sleep(0.6)  # one metrics refresh
    steps = metric(server, "hybrid_llm_engine_steps_total", phase="decode") - steps_before
    assert 0 < steps < sum(6 + i for i in range(16)) - 16  # they were decoded together


def client_sync(frontend: FrontendProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _raw_request(fe: FrontendProcess, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", fe.port), timeout=60)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize(("path", "stream"), [("/v1/chat/completions", True), ("/v1/completions", True),
                                               ("/v1/completions", False)])
def test_client_disconnect_cancels_and_frees_slot_and_pages(frontend: FrontendProcess, server: TritonServer,
                                                            client: openai.OpenAI, path: str, stream: bool) -> None:
    wait_for(lambda: idle(server), 15, "an idle server")
    cancelled = metric(server, "hybrid_llm_requests_finished_total", reason="cancelled")
    body: dict[str, Any] = {"model": M, "max_tokens": 450, "temperature": 0, "ignore_eos": True, "stream": stream}
    body.update({"messages": CHAT} if "chat" in path else {"prompt": PROMPT})
    sock = _raw_request(frontend, path, body)
    try:
        if stream:
            received = b""
            while received.count(b"data: ") < 4:  # a few chunks: the generation is under way
                chunk = sock.recv(65536)
                assert chunk, received
                received += chunk
            assert received.startswith(b"HTTP/1.1 200")
        wait_for(lambda: metric(server, "hybrid_llm_slots_in_use") == 1 and
                 metric(server, "hybrid_llm_kv_pages_in_use") > 0, 15, "the request to hold a slot and pages")
    finally:
        sock.close()
    wait_for(lambda: metric(server, "hybrid_llm_requests_finished_total", reason="cancelled") == cancelled + 1,
             15, "the Triton request to be cancelled")
    wait_for(lambda: idle(server), 15, "slots and KV pages back to 0")
    assert client.completions.create(model=M, prompt=PROMPT, max_tokens=3, **GREEDY).usage.completion_tokens == 3


# ---- errors -------------------------------------------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]
ERRORS: dict[str, tuple[str, Any, int, str, str | None, str]] = {
    # case: (path, body, status, type, code, text in the message)
    "body not JSON": ("/v1/completions", b"{model", 400, "invalid_request_error", "invalid_json", "not valid JSON"),
    "body not an object": ("/v1/completions", [1], 400, "invalid_request_error", "invalid_type", "JSON object"),
    "no model": ("/v1/completions", {"prompt": "x"}, 400, "invalid_request_error", "missing_required_parameter",
                 "model"),
    "unknown model": ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "invalid_request_error",
                      "model_not_found", "`nope` does not exist"),
    "unknown model, chat": ("/v1/chat/completions", {"model": "nope", "messages": MSG}, 404, "invalid_request_error",
                            "model_not_found", "does not exist"),
    "wrong type": ("/v1/completions", {"model": M, "prompt": "x", "temperature": "hot"}, 400,
                   "invalid_request_error", "invalid_type", "temperature"),
    "wrong type, chat": ("/v1/chat/completions", {"model": M, "messages": MSG, "stream": "yes"}, 400,
                         "invalid_request_error", "invalid_type", "stream"),
    "n > 1": ("/v1/completions", {"model": M, "prompt": "x", "n": 2}, 400, "invalid_request_error",
              "unsupported_value", "n must be 1"),
    "n > 1, chat": ("/v1/chat/completions", {"model": M, "messages": MSG, "n": 3}, 400, "invalid_request_error",
                    "unsupported_value", "n must be 1"),
    "echo": ("/v1/completions", {"model": M, "prompt": "x", "echo": True}, 400, "invalid_request_error",
             "unsupported_value", "echo must be false"),
    "max_tokens 0": ("/v1/completions", {"model": M, "prompt": "x", "max_tokens": 0}, 400, "invalid_request_error",
                     "invalid_value", "max_tokens"),
    "max_tokens over max_seq_len (Triton INVALID_ARG)": (
        "/v1/completions", {"model": M, "prompt": "x", "max_tokens": 5000}, 400, "invalid_request_error",
        "invalid_value", "max_seq_len=512"),
    "the same, streamed: still a 400": (
        "/v1/completions", {"model": M, "prompt": "x", "max_tokens": 5000, "stream": True}, 400,
        "invalid_request_error", "invalid_value", "max_seq_len=512"),
    "prompt over max_input_len (Triton INVALID_ARG)": (
        "/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "dog " * 600}]}, 400,
        "invalid_request_error", "invalid_value", "over max_input_len=384"),
    "temperature out of range (Triton INVALID_ARG)": (
        "/v1/completions", {"model": M, "prompt": "x", "temperature": 150}, 400, "invalid_request_error",
        "invalid_value", "temperature"),
    "token id out of the vocabulary (Triton INVALID_ARG)": (
        "/v1/completions", {"model": M, "prompt": [5, 999999]}, 400, "invalid_request_error", "invalid_value",
        "input_ids out of range"),
    "logprobs over 20": ("/v1/completions", {"model": M, "prompt": "x", "logprobs": 21}, 400,
                         "invalid_request_error", "invalid_value", "logprobs"),
    "top_logprobs without logprobs": ("/v1/chat/completions", {"model": M, "messages": MSG, "top_logprobs": 2}, 400,
                                      "invalid_request_error", "invalid_value", "requires logprobs=true"),
    "stream_options without stream": ("/v1/completions", {"model": M, "prompt": "x",
                                                          "stream_options": {"include_usage": True}}, 400,
                                      "invalid_request_error", "invalid_value", "stream is true"),
    "no chat template": ("/v1/chat/completions", {"model": "plain_llm", "messages": MSG}, 400,
                         "invalid_request_error", "chat_template_missing", "has no chat template"),
    "no messages": ("/v1/chat/completions", {"model": M, "messages": []}, 400, "invalid_request_error",
                    "invalid_value", "messages"),
    "image content": ("/v1/chat/completions", {"model": M, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
        "invalid_request_error", "unsupported_value", "text only"),
    "tools": ("/v1/chat/completions", {"model": M, "messages": MSG, "tools": [{"type": "function"}]}, 400,
              "invalid_request_error", "unsupported_value", "tools"),
    "unknown route": ("/v1/embeddings", {"model": M, "input": "x"}, 404, "invalid_request_error", None,
                      "Invalid URL"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_have_status_and_type(frontend: FrontendProcess, case: str) -> None:
    path, body, status, kind, code, text = ERRORS[case]
    got, headers, raw = post(frontend, path, body)
    assert got == status, raw
    assert headers["content-type"].startswith("application/json")
    err = json.loads(raw)["error"]
    assert (err["type"], err["code"]) == (kind, code), err
    assert text in err["message"] and "Traceback" not in err["message"]
    assert set(err) == {"message", "type", "param", "code"}


def test_unknown_fields_are_tolerated_and_the_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    r = client.completions.create(model=M, prompt=PROMPT, max_tokens=2, temperature=0, user="me", n=1,
                                  extra_body={"ignore_eos": True, "some_future_option": {"a": 1}})
    assert r.usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=MSG)
    assert nf.value.status_code == 404 and nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as br:
        client.completions.create(model=M, prompt="x", n=2)
    assert br.value.param == "n"
    with pytest.raises(openai.BadRequestError, match="chat template"):
        client.chat.completions.create(model="plain_llm", messages=MSG)
    with pytest.raises(openai.BadRequestError, match="max_seq_len"):
        list(client.chat.completions.create(model=M, messages=MSG, max_completion_tokens=5000, stream=True))


def test_503_when_triton_is_down_or_the_model_is_not_ready(default_bundle: Path, tmp_path: Path) -> None:
    """A frontend whose Triton is not there, then a Triton whose model failed to load."""
    grpc_port = free_port()
    fe = FrontendProcess(f"127.0.0.1:{grpc_port}", log_path=tmp_path / "frontend.log").start()
    server = TritonServer(parameters={"engine_dir": str(default_bundle), "multi_block_mode": "sometimes"},
                          grpc_port=grpc_port, exit_on_error=False, exit_timeout_s=1)
    try:
        wait_for(lambda: fe.health() != 0, 60, "the frontend to answer")
        for path, body in (("/health", None), ("/v1/models", None),
                           ("/v1/completions", {"model": M, "prompt": "x"})):
            status, _, raw = post(fe, path, body, method="POST" if body else "GET")
            err = json.loads(raw)["error"]
            assert status == 503 and err["type"] == "server_error" and "not reachable" in err["message"], raw
        server.start()
        server.wait("live", timeout=60)
        wait_for(lambda: "multi_block_mode" in server.log_text(), 30, "the model's load failure")
        # The frontend reconnects within its ~2 s gRPC backoff.
        wait_for(lambda: b"not reachable" not in post(fe, "/v1/completions", {"model": M, "prompt": "x"})[2], 15,
                 "the frontend to reach Triton")
        status, _, raw = post(fe, "/v1/completions", {"model": M, "prompt": "x"})
        err = json.loads(raw)["error"]
        assert status == 503 and err["type"] == "server_error" and "not ready" in err["message"], raw
        status, _, raw = post(fe, "/health", None, method="GET")
        assert status == 503 and "not ready" in json.loads(raw)["error"]["message"]
        status, _, raw = post(fe, "/v1/models", None, method="GET")
        assert status == 200 and json.loads(raw)["data"] == []
    finally:
        assert fe.stop() == 0
        log = fe.log_text()
        fe.cleanup()
        server.stop()
        server.cleanup()
    assert "Traceback" not in log, log[-3000:]
    assert not server.leaked_shm
