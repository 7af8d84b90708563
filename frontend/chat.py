"""Chat templates: found in a bundle the way transformers finds them, rendered the way transformers renders.

:meth:`ChatTemplate.from_dir` reads ``chat_template.jinja`` (the file transformers 5 writes; it wins) or
the ``chat_template`` of ``tokenizer_config.json`` (a string, or a list of named templates of which
"default" is used), plus the special tokens (``bos_token``, ``eos_token``, ...) that transformers hands
to the template. :meth:`ChatTemplate.render` mirrors transformers' ``apply_chat_template(tokenize=False)``:
a sandboxed jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, loop controls, a
``{% generation %}`` block, ``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape
HTML, and the reasoning-field aliases of transformers 5. The rendered text goes to the server, which
tokenizes it with its own tokenizer (special tokens in the text become control tokens, as in vLLM).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class ChatTemplateError(Exception):
    """The bundle's template cannot be read or does not compile (a deployment problem, not the client's)."""


class TemplateRenderError(ValueError):
    """The template refused these messages (``raise_exception``) or failed on them (the client's problem)."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}  # noqa: RUF012 - jinja's interface

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ChatTemplateError(f"{path} is not readable JSON: {e}") from e
    return data if isinstance(data, dict) else {}


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, origin: str = "<string>",
                 tokenizer_adds_bos: bool = False) -> None:
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        self.tokenizer_adds_bos = tokenizer_adds_bos
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template in {origin} does not compile: {e} (line {e.lineno})") from e

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTemplate | None:
        """The template of a bundle or checkpoint folder; None when it has none. Raises ChatTemplateError."""
        path = Path(path)
        config = _read_json(path / "tokenizer_config.json")
        specials = _read_json(path / "special_tokens_map.json")
        tokens = {}
        for key in SPECIAL_TOKEN_KEYS:
            text = _token_text(config.get(key)) or _token_text(specials.get(key))
            if text is not None:
                tokens[key] = text
        adds_bos = bool(config.get("add_bos_token", False))
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            try:
                return cls(jinja_file.read_text(encoding="utf-8"), tokens, str(jinja_file), adds_bos)
            except OSError as e:
                raise ChatTemplateError(f"cannot read {jinja_file}: {e}") from e
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default", next(iter(named.values()), None))
        if source is None:
            return None
        if not isinstance(source, str):
            raise ChatTemplateError(f"chat_template in {path / 'tokenizer_config.json'} is not a string")
        return cls(source, tokens, str(path / "tokenizer_config.json"), adds_bos)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text for ``messages`` (plain JSON values); ``template_kwargs`` are extra template
        variables (a request's ``chat_template_kwargs``, e.g. ``enable_thinking``). Raises TemplateRenderError."""
        kwargs = dict(template_kwargs or {})
        bad = sorted(RESERVED_KWARGS & set(kwargs))
        if bad:
            raise TemplateRenderError(f"chat_template_kwargs may not set {bad}")
        context = {**self.special_tokens, **kwargs}  # caller's kwargs win, as in transformers
        try:
            return self._template.render(messages=_alias_reasoning(messages), tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:  # raise_exception() in the template, or a sandbox violation
            raise TemplateRenderError(f"the chat template rejected the messages: {e.message or e}") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise TemplateRenderError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from e


    def for_server(self, prompt: str) -> str:
        """``prompt`` as the server should get it: when the server's tokenizer adds BOS itself
        (``add_bos_token``), a BOS the template wrote is dropped, so that it is not there twice."""
        bos = self.special_tokens.get("bos_token")
        if self.tokenizer_adds_bos and bos and prompt.startswith(bos):
            return prompt[len(bos):]
        return prompt


def _alias_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """transformers 5: a message's reasoning under any of its names is also given as ``reasoning_content``
    and ``thinking``, the names templates read."""
    out = []
    for m in messages:
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out
