"""Tokenizer wrapper, streaming (incremental) detokenizer and stop-string matcher.

`Tokenizer` loads a Hugging Face ``tokenizer.json`` (+ ``tokenizer_config.json``) with the ``tokenizers``
library. `IncrementalDetokenizer` turns generated ids into text deltas the way vLLM does (decode a small
window of previous tokens plus the new ones, emit only the difference, hold back incomplete UTF-8), so
that the concatenated deltas equal ``Tokenizer.decode`` of all ids. `StopStringMatcher` cuts the text
stream at the first stop string without ever emitting a part of it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers

REPLACEMENT_CHAR = "\ufffd"
INITIAL_DETOKENIZATION_OFFSET = 5  # prompt tokens decoded as context before the first generated one
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte-fallback pieces


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: vocabulary character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _has_decoder(state: Any, kind: str) -> bool:
    """Whether a decoder's JSON state (possibly a Sequence) contains a decoder of type ``kind``."""
    if isinstance(state, dict):
        return state.get("type") == kind or any(_has_decoder(v, kind) for v in state.values())
    if isinstance(state, list):
        return any(_has_decoder(v, kind) for v in state)
    return False


def _token_content(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string, a dict with "content", or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special-token facts of ``tokenizer_config.json``."""

    def __init__(self, tok: tokenizers.Tokenizer, config: dict[str, Any] | None = None,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self._tok = tok
        config = config or {}
        self._add_bos = bool(config.get("add_bos_token", False))
        # Special tokens named by the config that the tokenizer does not yet flag as special.
        names = [_token_content(config.get(k)) for k in ("eos_token", "bos_token", "pad_token", "unk_token")]
        names += [_token_content(t) for t in config.get("additional_special_tokens") or ()]
        for entry in (config.get("added_tokens_decoder") or {}).values():
            if isinstance(entry, dict) and entry.get("special"):
                names.append(_token_content(entry))
        known = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
        missing = [n for n in dict.fromkeys(names) if n and n not in known and tok.token_to_id(n) is not None]
        if missing:
            tok.add_special_tokens([tokenizers.AddedToken(n, special=True, normalized=False) for n in missing])
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, t in tok.get_added_tokens_decoder().items() if t.special)
        eos = _token_content(config.get("eos_token"))
        eos_id = tok.token_to_id(eos) if eos else None
        merged = ([eos_id] if eos_id is not None else []) + [int(i) for i in eos_token_ids]
        self._eos_ids = tuple(dict.fromkeys(merged))
        bos = _token_content(config.get("bos_token"))
        self._bos_id = tok.token_to_id(bos) if bos else None
        self._added_ids = frozenset(tok.get_added_tokens_decoder())
        decoder = tok.decoder
        self._byte_level = decoder is not None and _has_decoder(json.loads(decoder.__getstate__()), "ByteLevel")
        self._bytes: dict[int, bytes] = {}

    @classmethod
    def from_dir(cls, path: str | Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Load ``path/tokenizer.json`` and, if present, ``path/tokenizer_config.json``.

        ``eos_token_ids`` (e.g. from ``generation_config.json``) are merged after the config's eos_token.
        """
        path = Path(path)
        tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        return cls(tok, config, eos_token_ids)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation (config eos_token first, then the caller's), without duplicates."""
        return self._eos_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no special tokens are added except BOS when ``add_bos_token`` is set."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self._add_bos and self._bos_id is not None:
            ids = [self._bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (invalid UTF-8 byte sequences come out as U+FFFD)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of ``token_id`` (byte-level form), or None if out of range."""
        return self._tok.id_to_token(int(token_id))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes that ``token_id`` stands for on its own (possibly a fragment of a UTF-8 character).

        Added tokens (special ones included) are their content in UTF-8; with a byte-level decoder (GPT-2,
        Qwen) each character of the vocabulary string is one byte; a SentencePiece ``<0xNN>`` piece is
        that byte; any other token is the UTF-8 of its decoded text. Raises ValueError for an unknown id.
        """
        token_id = int(token_id)
        out = self._bytes.get(token_id)
        if out is not None:
            return out
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary")
        table = _byte_level_decoder()
        m = _BYTE_PIECE.match(piece)
        if token_id in self._added_ids:
            out = piece.encode("utf-8")
        elif self._byte_level and all(c in table for c in piece):
            out = bytes(table[c] for c in piece)
        elif m is not None:
            out = bytes([int(m.group(1), 16)])
        else:
            out = self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")
        self._bytes[token_id] = out  # a plain dict: at most one entry per vocabulary id
        return out


class IncrementalDetokenizer:
    """Streams the text of generated tokens, one delta per `push`.

    Keeps ``prefix_offset``/``read_offset`` into the id list: the text already emitted ends at
    ``read_offset``, and decoding starts at ``prefix_offset`` so that decoders which depend on the left
    context (leading-space stripping, byte-level merges) see the same context as a full decode. A delta
    is held back while the decoded text ends with U+FFFD (an incomplete multi-byte character).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = [int(i) for i in prompt_ids]
        self._prompt_len = self._read = len(self._ids)
        self._prefix = max(self._read - INITIAL_DETOKENIZATION_OFFSET, 0)
        self._prefix_text = self._decode(self._prefix, self._read)
        self._parts: list[str] = []

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self._tok.decode(self._ids[start:stop], skip_special_tokens=self._skip)

    def _advance(self, final: bool) -> str:
        new_text = self._decode(self._prefix)
        if len(new_text) <= len(self._prefix_text) or (not final and new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        delta = new_text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._prefix, self._read)
        self._parts.append(delta)
        return delta

    def push(self, token_id: int) -> str:
        """Add one generated id; return the newly complete text (possibly "")."""
        self._ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """End of generation: return the held-back text, incomplete characters as U+FFFD."""
        return self._advance(final=True)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._parts)

    @property
    def token_ids(self) -> list[int]:
        """The generated ids pushed so far (prompt excluded)."""
        return self._ids[self._prompt_len:]


class StopStringMatcher:
    """Cuts a growing text stream at the first occurrence of any stop string.

    `feed` returns the text that is safe to emit: a suffix that could still grow into a stop string is
    held back, and on a hit the stop string and everything after it are dropped.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended generation

    def feed(self, delta: str) -> tuple[str, bool]:
        """Append ``delta``; return ``(text to emit now, whether a stop string was hit)``."""
        if self.stopped:
            return "", True
        buf = self._held + delta
        hit, hit_at = None, len(buf)
        for s in self._stops:
            i = buf.find(s)
            if i != -1 and (i < hit_at or (i == hit_at and len(s) > len(hit or ""))):
                hit, hit_at = s, i
        if hit is not None:
            self._held, self.stopped, self.matched = "", True, hit
            return buf[:hit_at], True
        hold = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:n]):
                    hold = n
                    break
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """End of generation without a hit: release the held-back text."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out
