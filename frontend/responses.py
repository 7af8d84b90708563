"""OpenAI response objects and stream chunks, built from the server's :class:`~frontend.triton.Piece` objects.

A :class:`Choice` accumulates one choice's output (text, token count, logprob entries and their text
offsets, finish reason, prompt length). :class:`CompletionFormat` and :class:`ChatFormat` turn pieces into
the chunks OpenAI streams and choices into the final object, for ``/v1/completions`` and
``/v1/chat/completions``. Token counts in ``usage`` are the server's: the ids it generated and the
prompt length it tokenized (``num_input_tokens``), never a re-tokenization of the text.

Logprob entries arrive from the model as ``{"token_id", "token", "bytes", "logprob", "top_logprobs"}``
(config.pbtxt, ``output_logprobs``); completions get ``tokens`` / ``token_logprobs`` / ``top_logprobs``
(a dict with the sampled token and the most likely ones, up to logprobs + 1 entries, as OpenAI documents) /
``text_offset``; chat gets ``content`` items with ``token``, ``logprob``, ``bytes``, ``top_logprobs``.
"""

from __future__ import annotations

from typing import Any

from .triton import Piece


class Choice:
    """The output of one choice so far."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.parts: list[str] = []
        self.length = 0  # characters of text so far
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.finish_reason: str | None = None
        self.logprobs: list[dict[str, Any]] = []
        self.offsets: list[int] = []

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, piece: Piece) -> tuple[list[dict[str, Any]], list[int]]:
        """Take one piece; returns its logprob entries and their offsets into the choice's text."""
        start = self.length
        entries = piece.logprobs or []
        # The first id of a piece starts where its text starts; later ids of the same piece (an EOS, or the
        # token held for the final response) sit at its end.
        offsets = [start if i == 0 else start + len(piece.text) for i in range(len(entries))]
        self.parts.append(piece.text)
        self.length += len(piece.text)
        self.completion_tokens += len(piece.token_ids)
        self.logprobs.extend(entries)
        self.offsets.extend(offsets)
        if piece.final:
            self.finish_reason = piece.finish_reason if piece.finish_reason in ("stop", "length") else "stop"
            self.prompt_tokens = piece.num_input_tokens or 0
        return entries, offsets


def usage(choices: list[Choice]) -> dict[str, int]:
    prompt = sum(c.prompt_tokens for c in choices)
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _Format:
    object_name = ""
    chunk_name = ""

    def __init__(self, request_id: str, model: str, created: int, logprobs: bool, include_usage: bool) -> None:
        self.id, self.model, self.created = request_id, model, created
        self.want_logprobs = logprobs
        self.include_usage = include_usage

    def _envelope(self, name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": name, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = self._envelope(self.chunk_name, choices)
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        return {**self._envelope(self.chunk_name, []), "usage": usage(choices)}

    def start(self, choices: list[Choice]) -> list[dict[str, Any]]:
        """Chunks sent before the first piece's (none by default)."""
        return []

    def on_piece(self, choice: Choice, piece: Piece) -> list[dict[str, Any]]:
        """Take a piece into ``choice``; returns the chunks to stream for it."""
        entries, offsets = choice.add(piece)
        out = []
        if piece.text or (self.want_logprobs and entries):
            out.append(self.chunk([self._delta(choice.index, piece.text, entries, offsets)]))
        if piece.final:
            out.append(self.chunk([self._finish(choice.index, choice.finish_reason or "stop")]))
        return out

    def _delta(self, index: int, text: str, entries: list[dict[str, Any]], offsets: list[int]) -> dict[str, Any]:
        raise NotImplementedError

    def _finish(self, index: int, reason: str) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormat(_Format):
    """``/v1/completions``: ``text_completion`` objects."""

    object_name = chunk_name = "text_completion"

    def _logprobs(self, entries: list[dict[str, Any]], offsets: list[int]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        top = []
        for e in entries:
            d = {t["token"]: t["logprob"] for t in e["top_logprobs"]}
            d.setdefault(e["token"], e["logprob"])  # the sampled token is always listed
            top.append(d)
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": top, "text_offset": list(offsets)}

    def _delta(self, index: int, text: str, entries: list[dict[str, Any]], offsets: list[int]) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": self._logprobs(entries, offsets), "finish_reason": None}

    def _finish(self, index: int, reason: str) -> dict[str, Any]:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": reason}

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        return {**self._envelope(self.object_name, [
            {"index": c.index, "text": c.text, "logprobs": self._logprobs(c.logprobs, c.offsets),
             "finish_reason": c.finish_reason} for c in choices]), "usage": usage(choices)}


class ChatFormat(_Format):
    """``/v1/chat/completions``: ``chat.completion`` objects and ``chat.completion.chunk`` chunks."""

    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"

    def _logprobs(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]}
                                              for t in e["top_logprobs"]]} for e in entries],
                "refusal": None}

    def start(self, choices: list[Choice]) -> list[dict[str, Any]]:
        return [self.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]) for c in choices]

    def _delta(self, index: int, text: str, entries: list[dict[str, Any]], offsets: list[int]) -> dict[str, Any]:
        return {"index": index, "delta": {"content": text}, "logprobs": self._logprobs(entries),
                "finish_reason": None}

    def _finish(self, index: int, reason: str) -> dict[str, Any]:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        return {**self._envelope(self.object_name, [
            {"index": c.index, "message": {"role": "assistant", "content": c.text, "refusal": None},
             "logprobs": self._logprobs(c.logprobs), "finish_reason": c.finish_reason} for c in choices]),
            "usage": usage(choices)}
