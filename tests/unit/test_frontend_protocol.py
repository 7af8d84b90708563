"""The OpenAI frontend without a server: chat templates against transformers, request parsing, response
objects, error mapping. (Live: tests/integration/test_frontend.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from frontend.chat import ChatTemplate, ChatTemplateError, TemplateRenderError
from frontend.errors import APIError, from_grpc_status
from frontend.protocol import ChatCompletionRequest, CompletionRequest, parse
from frontend.responses import ChatFormat, Choice, CompletionFormat
from frontend.triton import Piece, _generation_defaults, follows_convention, stream_error

# A Qwen2.5-style template: default system prompt, tools as JSON, loop controls, namespace, raise_exception.
QWEN_LIKE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}You are helpful.{%- endif %}
    {{- "\\n\\n# Tools\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(users=0) %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}
    {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
    {%- if message.role == 'user' %}{%- set ns.users = ns.users + 1 %}{%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}
    {%- generation %}{{- message.content }}{%- endgeneration %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is false %}<think></think>{% endif %}
{%- endif %}
{{- '' if ns.users else raise_exception('no user message') }}"""

BOS_TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] | trim }}\n{% endfor %}"

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"},
     {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
     {"role": "user", "content": "  café, 中文  "}],
]


def _folder(tmp: Path, default_checkpoint: Path, config_extra: dict, jinja: str | None = None) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    shutil.copy(default_checkpoint / "tokenizer.json", tmp / "tokenizer.json")
    config = json.loads((default_checkpoint / "tokenizer_config.json").read_text())
    (tmp / "tokenizer_config.json").write_text(json.dumps({**config, **config_extra}))
    if jinja is not None:
        (tmp / "chat_template.jinja").write_text(jinja)
    return tmp


def _transformers(folder: Path, messages: list[dict], **kw) -> str:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    return tok.apply_chat_template(messages, tokenize=False, **kw)


@pytest.mark.parametrize("kind", ["default_chatml", "qwen_like_jinja_file", "bos_in_tokenizer_config",
                                  "named_list"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers_does(kind: str, add_generation_prompt: bool, default_checkpoint: Path,
                                      tmp_path: Path) -> None:
    if kind == "default_chatml":
        folder = default_checkpoint
    elif kind == "qwen_like_jinja_file":
        folder = _folder(tmp_path, default_checkpoint, {"chat_template": "ignored: the .jinja file wins"}, QWEN_LIKE)
    elif kind == "bos_in_tokenizer_config":
        folder = _folder(tmp_path, default_checkpoint, {"chat_template": BOS_TEMPLATE, "bos_token": "<|im_start|>"})
    else:
        folder = _folder(tmp_path, default_checkpoint, {"chat_template": [
            {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": BOS_TEMPLATE}],
            "bos_token": "<|im_start|>"})
    template = ChatTemplate.from_dir(folder)
    assert template is not None
    for messages in CONVERSATIONS:
        expect = _transformers(folder, messages, add_generation_prompt=add_generation_prompt)
        assert template.render(messages, add_generation_prompt=add_generation_prompt) == expect
    if kind == "qwen_like_jinja_file":
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
        kw = {"enable_thinking": False}
        assert template.render(CONVERSATIONS[1], tools=tools, template_kwargs=kw) == _transformers(
            folder, CONVERSATIONS[1], tools=tools, add_generation_prompt=True, **kw)


def test_template_errors(default_checkpoint: Path, tmp_path: Path) -> None:
    folder = _folder(tmp_path / "q", default_checkpoint, {}, QWEN_LIKE)
    template = ChatTemplate.from_dir(folder)
    with pytest.raises(TemplateRenderError, match="unknown role robot"):
        template.render([{"role": "robot", "content": "x"}, {"role": "user", "content": "y"}])
    with pytest.raises(TemplateRenderError, match="no user message"):
        template.render([{"role": "system", "content": "x"}])
    with pytest.raises(TemplateRenderError, match="may not set"):
        template.render(CONVERSATIONS[0], template_kwargs={"messages": []})
    broken = _folder(tmp_path / "b", default_checkpoint, {}, "{% for m in messages %}{{ m }")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate.from_dir(broken)
    assert ChatTemplate.from_dir(_folder(tmp_path / "none", default_checkpoint, {})) is None
    bos = ChatTemplate.from_dir(_folder(tmp_path / "bos", default_checkpoint, {
        "chat_template": BOS_TEMPLATE, "bos_token": "<|im_start|>", "add_bos_token": True}))
    text = bos.render(CONVERSATIONS[0])
    assert text.startswith("<|im_start|>[USER]") and bos.for_server(text) == text[len("<|im_start|>"):]
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(TemplateRenderError, match="rejected"):
        sandboxed.render(CONVERSATIONS[0])


# ---- requests -----------------------------------------------------------------------------------------

def test_completion_request_to_sampling_parameters() -> None:
    req = parse({"model": "m", "prompt": "Hi", "max_tokens": 7, "temperature": 0, "top_p": 0.9, "seed": 3,
                 "stop": "\n", "logprobs": 2, "top_k": 5, "min_tokens": 1, "ignore_eos": True,
                 "stop_token_ids": [4], "some_future_field": {"x": 1}, "user": "u"}, CompletionRequest)
    assert req.sampling({"temperature": 1.0, "top_k": 20}) == {
        "temperature": 0, "top_p": 0.9, "top_k": 5, "seed": 3, "stop": ["\n"], "stop_token_ids": [4],
        "min_tokens": 1, "ignore_eos": True, "max_tokens": 7, "logprobs": 2}
    assert req.prompts() == ["Hi"]
    bare = parse({"model": "m", "prompt": [1, 2, 3]}, CompletionRequest)
    assert bare.sampling({"temperature": 0.7, "top_p": 0.8}) == {"temperature": 0.7, "top_p": 0.8}
    assert bare.prompts() == [[1, 2, 3]]  # token ids go to the server as input_ids
    assert parse({"model": "m", "prompt": ["a", "b"]}, CompletionRequest).prompts() == ["a", "b"]
    assert parse({"model": "m", "prompt": [[1], [2, 3]]}, CompletionRequest).prompts() == [[1], [2, 3]]


def test_chat_request_to_sampling_parameters() -> None:
    req = parse({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]},
                                            {"role": "assistant", "content": None, "tool_calls": []}],
                 "max_tokens": 9, "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 3},
                ChatCompletionRequest)
    assert req.sampling({}) == {"max_tokens": 4, "logprobs": 3}
    assert req.template_messages() == [{"role": "user", "content": "a\nb"},
                                       {"role": "assistant", "content": None, "tool_calls": []}]
    assert parse({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True},
                 ChatCompletionRequest).sampling({})["logprobs"] == 0
    assert "logprobs" not in parse({"model": "m", "messages": [{"role": "user", "content": "x"}]},
                                   ChatCompletionRequest).sampling({})


BAD = [
    ({"prompt": "x"}, "model", "missing_required_parameter"),
    ({"model": "m", "prompt": 5}, "prompt", "invalid_type"),
    ({"model": "m", "prompt": "x", "temperature": "0.5"}, "temperature", "invalid_type"),
    ({"model": "m", "prompt": "x", "temperature": -1}, "temperature", "invalid_value"),
    ({"model": "m", "prompt": "x", "max_tokens": 2.0}, "max_tokens", "invalid_type"),
    ({"model": "m", "prompt": "x", "stream": 1}, "stream", "invalid_type"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p", "invalid_value"),
    ({"model": "m", "prompt": "x", "seed": -1}, "seed", "invalid_value"),
    ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs", "invalid_value"),
    ({"model": "m", "prompt": "x", "stop": ["a", 1]}, "stop", "invalid_type"),
    ({"model": "m", "prompt": "x", "stop": [""]}, "stop", "invalid_value"),
    ({"model": "m", "prompt": "x", "n": 2}, "n", "unsupported_value"),
    ({"model": "m", "prompt": "x", "echo": True}, "echo", "unsupported_value"),
    ({"model": "m", "prompt": "x", "best_of": 2}, "best_of", "unsupported_value"),
    ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix", "unsupported_value"),
    ({"model": "m", "prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "unsupported_value"),
    ({"model": "m", "prompt": "x", "logit_bias": {"1": 2.0}}, "logit_bias", "unsupported_value"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({"model": "m", "messages": []}, "messages", "invalid_value"),
    ({"model": "m", "messages": [{"content": "x"}]}, "messages.0.role", "missing_required_parameter"),
    ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages.0.content", "invalid_type"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "invalid_value"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools",
     "unsupported_value"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     "response_format", "unsupported_value"),
]


@pytest.mark.parametrize(("body", "param", "code"), BAD)
def test_bad_requests_name_the_field(body: dict, param: str, code: str) -> None:
    kind = ChatCompletionRequest if "messages" in body else CompletionRequest
    with pytest.raises(APIError) as ei:
        parse(body, kind)
    e = ei.value
    assert (e.status, e.param, e.code, e.type) == (400, param, code, "invalid_request_error")
    assert param.split(".")[0] in e.message


def test_content_parts_and_prompts_are_checked() -> None:
    req = parse({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                ChatCompletionRequest)
    with pytest.raises(APIError, match="text only") as ei:
        req.template_messages()
    assert ei.value.param == "messages.0.content.0"
    for prompt, match in (("", "empty"), ([], "empty list"), (["a", ""], "prompt 1 is empty"),
                          ([["a"] * 0] * 65, "at most 64")):
        with pytest.raises(APIError, match=match):
            parse({"model": "m", "prompt": prompt}, CompletionRequest).prompts()
    with pytest.raises(APIError, match="JSON object"):
        parse([1, 2], CompletionRequest)


# ---- responses ----------------------------------------------------------------------------------------

def _entry(token_id: int, token: str, lp: float, top: list[tuple[int, str, float]]) -> dict:
    def one(i: int, t: str, v: float) -> dict:
        return {"token_id": i, "token": t, "bytes": list(t.encode()), "logprob": v}
    return {**one(token_id, token, lp), "top_logprobs": [one(*x) for x in top]}


PIECES = [Piece("Hel", [5], [_entry(5, "Hel", -0.1, [(5, "Hel", -0.1), (6, "He", -2.0)])], False),
          Piece("", [7], [_entry(7, "bytes:\\xe4", -0.5, [(8, "x", -0.2), (9, "y", -0.3)])], False),
          Piece("lo", [3, 0], [_entry(3, "lo", -0.3, [(3, "lo", -0.3), (4, "l", -1.0)]),
                               _entry(0, "<eos>", -1.5, [(0, "<eos>", -1.5), (1, "a", -2.0)])], True, "stop", 11)]


def test_completion_objects() -> None:
    fmt = CompletionFormat("cmpl-1", "m", 123, logprobs=True, include_usage=True)
    choice = Choice(0)
    chunks = [c for p in PIECES for c in fmt.on_piece(choice, p)]
    assert [c["choices"][0]["text"] for c in chunks] == ["Hel", "", "lo", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "stop"]
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in chunks)
    lp = chunks[2]["choices"][0]["logprobs"]
    assert lp["tokens"] == ["lo", "<eos>"] and lp["text_offset"] == [3, 5]
    assert fmt.usage_chunk([choice]) == {"id": "cmpl-1", "object": "text_completion", "created": 123, "model": "m",
                                         "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 4,
                                                                  "total_tokens": 15}}
    whole = fmt.response([choice])
    c = whole["choices"][0]
    assert c["text"] == "Hello" and c["finish_reason"] == "stop" and whole["usage"]["completion_tokens"] == 4
    assert c["logprobs"]["token_logprobs"] == [-0.1, -0.5, -0.3, -1.5]
    assert c["logprobs"]["text_offset"] == [0, 3, 3, 5]
    # The sampled token is always in top_logprobs, beside the N most likely (up to N + 1 entries).
    assert c["logprobs"]["top_logprobs"][1] == {"x": -0.2, "y": -0.3, "bytes:\\xe4": -0.5}


def test_chat_objects() -> None:
    fmt = ChatFormat("chatcmpl-1", "m", 123, logprobs=False, include_usage=False)
    choice = Choice(0)
    start = fmt.start([choice])
    chunks = [c for p in PIECES for c in fmt.on_piece(choice, p)]
    assert start[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"] for c in chunks] == [{"content": "Hel"}, {"content": "lo"}, {}]
    assert "usage" not in chunks[0] and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    fmt = ChatFormat("chatcmpl-1", "m", 123, logprobs=True, include_usage=False)
    choice = Choice(0)
    chunks = [c for p in PIECES for c in fmt.on_piece(choice, p)]
    assert len(chunks) == 4  # with logprobs the held-back token gets its own (empty) chunk
    item = fmt.response([choice])["choices"][0]["logprobs"]["content"][0]
    assert item == {"token": "Hel", "logprob": -0.1, "bytes": list(b"Hel"),
                    "top_logprobs": [{"token": "Hel", "logprob": -0.1, "bytes": list(b"Hel")},
                                     {"token": "He", "logprob": -2.0, "bytes": list(b"He")}]}
    assert fmt.response([choice])["choices"][0]["message"] == {"role": "assistant", "content": "Hello",
                                                               "refusal": None}


# ---- errors and discovery ------------------------------------------------------------------------------

@pytest.mark.parametrize(("code", "status", "kind"), [
    ("INVALID_ARGUMENT", 400, "invalid_request_error"), ("NOT_FOUND", 404, "invalid_request_error"),
    ("UNAVAILABLE", 503, "server_error"), ("INTERNAL", 500, "server_error"), ("UNKNOWN", 500, "server_error"),
    ("CANCELLED", 503, "server_error"), ("DEADLINE_EXCEEDED", 504, "server_error")])
def test_grpc_status_mapping(code: str, status: int, kind: str) -> None:
    e = from_grpc_status(code, "why", "127.0.0.1:8001")
    assert (e.status, e.type) == (status, kind) and "why" in e.message
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(("message", "status", "text"), [
    ("[INVALID_ARG] the prompt is empty", 400, "the prompt is empty"),
    ("[UNAVAILABLE] the model is shutting down", 503, "the model is shutting down"),
    ("[INTERNAL] engine failure: RuntimeError('x')", 500, "engine failure"),
    ("Request for unknown model: 'x' is not found", 404, "unknown model"),
    ("the model is not ready", 503, "not ready"),
    ("something else entirely", 500, "something else")])
def test_in_stream_errors(message: str, status: int, text: str) -> None:
    e = stream_error(message, "127.0.0.1:8001")
    assert e.status == status and text in e.message and not e.message.startswith("[")


def test_model_convention_and_sampling_defaults(tmp_path: Path) -> None:
    cfg = {"model_transaction_policy": {"decoupled": True},
           "input": [{"name": n} for n in ("text_input", "stream", "sampling_parameters", "exclude_input_in_output")],
           "output": [{"name": n} for n in ("text_output", "output_ids", "finish_reason", "num_input_tokens")]}
    assert follows_convention(cfg)
    assert not follows_convention({**cfg, "model_transaction_policy": {}})
    assert not follows_convention({**cfg, "output": cfg["output"][:1]})
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                                 "do_sample": True, "eos_token_id": [1, 2]}))
    assert _generation_defaults(tmp_path) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert _generation_defaults(tmp_path / "missing") == {}
