"""Shared fixtures: tiny checkpoints with a real (trained) tokenizer, and built bundles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def write_tiny_tokenizer(folder: Path, vocab_size: int) -> None:
    """Train a small byte-level BPE on a few sentences; ids stay below ``vocab_size``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["The quick brown fox jumps over the lazy dog.", "Serving hybrid models needs state slots.",
            "Ünïcödé text: café, 中文, emoji 🙂."] * 20
    tok.train_from_iterator(text, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                              "tokenizer_class": "PreTrainedTokenizerFast"}))


@pytest.fixture(scope="session")
def default_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default model, written once per test session."""
    from builder.default_model import write_default_checkpoint

    out = tmp_path_factory.mktemp("default_ckpt")
    write_default_checkpoint(out, progress=lambda _m: None)
    return out


@pytest.fixture(scope="session")
def default_bundle(default_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model built with small limits (max batch 16) for runtime tests."""
    from builder.bundle import BuildOptions, build_bundle

    out = tmp_path_factory.mktemp("bundles") / "default"
    build_bundle(default_checkpoint, out, BuildOptions(max_batch_size=16, max_input_len=384, max_seq_len=512,
                                                       max_num_tokens=256), progress=lambda _m: None)
    return out
