"""Tokenizer wrapper, incremental detokenizer and stop-string matcher, on a small trained byte-level BPE."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from hybrid_runtime.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

EOS = "<|endoftext|>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "Serving hybrid language models needs paged attention caches and recurrent state slots.",
    "Le café était très agréable, et l'été à Genève fut ensoleillé. Où est la bibliothèque ?",
    "我们今天学习中文。中文的字符在字节级分词器里会被拆开。你好，世界！",
    "Emoji test: 🙂 🚀 🎉 👍🏽 — smiles and rockets 🚀🚀 and naïve façades.",
    "def main():\n    print('hello world')\n    return 0\n\n",
    "Numbers 12345 and 67890, spaces   and\ttabs, newlines\n\nend.",
]
TEXTS = [
    "Hello world, the fox and the café.",
    "中文字符 and 🙂 emoji 🚀 mixed   with  spaces.",
    " leading space and trailing space ",
    "naïve façade — été 👍🏽 你好，世界！",
    "a\n\n  b\tc  ",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 3, trainer)
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    config = {"eos_token": {"content": EOS, "special": True}, "bos_token": None, "add_bos_token": False}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir, eos_token_ids=[7])


def stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt or [])
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    assert detok.token_ids == ids
    return deltas


def test_loads_config(tok: Tokenizer) -> None:
    eos = tok._tok.token_to_id(EOS)
    assert tok.eos_token_ids == (eos, 7)
    assert tok.bos_token_id is None
    assert 400 <= tok.vocab_size <= 500
    assert tok.id_to_token(eos) == EOS
    assert tok.id_to_token(10**6) is None
    assert tok.decode(tok.encode("Hello" + EOS + " world")) == "Hello world"
    assert tok.decode(tok.encode("a" + EOS), skip_special_tokens=False) == "a" + EOS


def test_config_string_eos_and_bos(tok_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOS, "bos_token": EOS, "add_bos_token": True}))
    t = Tokenizer.from_dir(tmp_path, eos_token_ids=[5, 0])
    eos = t.id_to_token(t.eos_token_ids[0])
    assert eos == EOS and t.eos_token_ids == (0, 5)  # config's first, caller's merged without duplicates
    assert t.encode("hi")[0] == t.bos_token_id == t.eos_token_ids[0]
    # No config file at all: nothing special besides what tokenizer.json flags.
    (tmp_path / "tokenizer_config.json").unlink()
    bare = Tokenizer.from_dir(tmp_path)
    assert bare.eos_token_ids == () and bare.bos_token_id is None


def test_multibyte_chars_are_split(tok: Tokenizer) -> None:
    # The fixture must exercise the hard case: some single token decodes to an incomplete character.
    ids = [i for text in TEXTS for i in tok.encode(text)]
    assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_decode_for_texts(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_stream_with_prompt_context(tok: Tokenizer) -> None:
    prompt = tok.encode("Le café 🙂")
    ids = tok.encode(" était très 中文 🚀 agréable")
    deltas = stream(tok, ids, prompt)
    assert "".join(deltas) == " était très 中文 🚀 agréable"
    assert not any("\ufffd" in d for d in deltas)


def test_stream_random_valid_texts(tok: Tokenizer) -> None:
    rng = random.Random(0)
    alphabet = [*"abc xyz  \n\té中文字🙂🚀👍🏽,.!", "the ", " fox", EOS]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        ids = tok.encode(text)
        deltas = stream(tok, ids)
        full = tok.decode(ids)
        assert "".join(deltas) == full == text.replace(EOS, "")
        assert not any("\ufffd" in d for d in deltas)


def test_stream_random_token_sequences(tok: Tokenizer) -> None:
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        deltas = stream(tok, ids)
        full = tok.decode(ids)
        assert "".join(deltas) == full
        if "\ufffd" not in full:
            assert not any("\ufffd" in d for d in deltas)


def test_stream_holds_back_partial_character(tok: Tokenizer) -> None:
    ids = tok.encode("🙂")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "🙂"
    # Generation ending inside a character: flush releases the replacement character.
    detok2 = IncrementalDetokenizer(tok)
    detok2.push(ids[0])
    assert detok2.flush() == tok.decode(ids[:1])


def test_stream_skips_special_tokens_and_keeps_spaces(tok: Tokenizer) -> None:
    eos = tok.eos_token_ids[0]
    ids = [*tok.encode("one  two "), eos, *tok.encode(" three")]
    deltas = stream(tok, ids)
    assert "".join(deltas) == "one  two  three"
    assert deltas[len(ids) - len(tok.encode(" three")) - 1] == ""  # the EOS push emits nothing


def run_matcher(stops: list[str], deltas: list[str]) -> tuple[str, bool, StopStringMatcher]:
    m = StopStringMatcher(stops)
    out, hit = [], False
    for d in deltas:
        emit, hit = m.feed(d)
        out.append(emit)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    return "".join(out), hit, m


def test_stop_string_split_across_deltas() -> None:
    text, hit, m = run_matcher(["STOP"], ["Hello S", "T", "O", "P and more"])
    assert (text, hit, m.matched) == ("Hello ", True, "STOP")
    assert m.feed("later") == ("", True) and m.flush() == ""


def test_stop_string_holdback_and_release() -> None:
    m = StopStringMatcher(["</end>"])
    assert m.feed("abc</e") == ("abc", False)
    assert m.feed("x") == ("</ex", False)
    assert m.feed("</") == ("", False)
    assert m.flush() == "</"
    text, hit, _ = run_matcher(["xyz"], ["a", "x", "y"])
    assert (text, hit) == ("axy", False)


def test_stop_earliest_of_several() -> None:
    text, hit, m = run_matcher(["world", "o", "lo w"], ["hel", "lo wor", "ld"])
    assert (text, hit, m.matched) == ("hel", True, "lo w")
    text, hit, m = run_matcher(["ab", "abc"], ["xab", "c"])
    assert (text, hit, m.matched) == ("x", True, "ab")


def test_stop_random_splits_match_reference() -> None:
    rng = random.Random(2)
    stops = ["\n\n", "END", "é中", "🚀!"]
    pieces = ["a", "b", "\n", "E", "N", "D", "é", "中", "🚀", "!", " "]
    for _ in range(300):
        full = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(full) + 1), k=min(len(full) + 1, rng.randint(0, 6))))
        deltas = [full[i:j] for i, j in zip([0, *cuts], [*cuts, len(full)])]
        found = [(full.find(s), s) for s in stops if s in full]
        expected = full[: min(found)[0]] if found else full
        text, hit, _ = run_matcher(stops, deltas)
        assert (text, hit) == (expected, bool(found))


def test_stop_with_detokenizer(tok: Tokenizer) -> None:
    ids = tok.encode("The fox 🚀 jumps. STOP here 中文")
    detok, m = IncrementalDetokenizer(tok), StopStringMatcher(["STOP", "🚀 x"])
    out = []
    for i in ids:
        emit, hit = m.feed(detok.push(i))
        out.append(emit)
        if hit:
            break
    assert "".join(out) == "The fox 🚀 jumps. "


def test_token_bytes_of_a_byte_level_tokenizer(default_bundle: Path) -> None:
    tok = Tokenizer.from_dir(default_bundle)
    text = "Serving hybrid models: café, 中文, emoji 🙂\n\ttabs <|im_end|>"
    ids = tok.encode(text)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode("utf-8")  # every byte once, fragments of characters included
    assert any(len(p) == 1 and p[0] >= 0x80 for p in pieces)
    assert tok.token_bytes(ids[-1]) == b"<|im_end|>"  # a special (added) token is its content
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.token_bytes(10**6)


def test_token_bytes_of_a_byte_fallback_tokenizer() -> None:
    vocab = {"<unk>": 0, "<0xE4>": 1, "<0xB8>": 2, "<0xAD>": 3, "▁a": 4, "b": 5}
    raw = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    raw.decoder = tokenizers.decoders.Sequence([tokenizers.decoders.Replace("▁", " "),
                                                tokenizers.decoders.ByteFallback(), tokenizers.decoders.Fuse()])
    tok = Tokenizer(raw)
    assert [tok.token_bytes(i) for i in (1, 2, 3)] == [b"\xe4", b"\xb8", b"\xad"]
    assert tok.token_bytes(4) == b" a" and tok.token_bytes(5) == b"b"
