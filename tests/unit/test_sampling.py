"""SamplingParams validation / JSON parsing and the host sampler."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hybrid_runtime.sampler import _draw, _nucleus, _top_k_ids, make_rng, sample
from hybrid_runtime.sampling import RequestValidationError, SamplingParams

V = 64


def rows(batch: int, seed: int = 0, vocab: int = V) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, vocab)).astype(np.float32) * 3


# ---- SamplingParams -----------------------------------------------------------------------------

def test_defaults_and_none() -> None:
    assert SamplingParams.from_json(None) == SamplingParams()
    assert SamplingParams.from_json("") == SamplingParams()
    assert SamplingParams.from_json(b"{}") == SamplingParams()
    d = SamplingParams(max_tokens=100, temperature=0.5)
    assert SamplingParams.from_json('{"top_k": 5}', defaults=d) == SamplingParams(100, 0.5, top_k=5)
    assert SamplingParams.from_json({"seed": None}, defaults=d) == d  # null keeps the default


def test_full_parse_with_strings() -> None:
    text = json.dumps({
        "max_tokens": "32", "temperature": "0.7", "top_k": "40", "top_p": "0.9", "seed": "123",
        "stop": ["\n\n", "END"], "stop_token_ids": ["5", 6], "ignore_eos": "true", "min_tokens": 2,
        "n": 1, "best_of": "1", "presence_penalty": 0, "frequency_penalty": "0.0",
        "repetition_penalty": 1.0, "logprobs": None,
    })
    p = SamplingParams.from_json(text.encode())
    assert p == SamplingParams(max_tokens=32, temperature=0.7, top_k=40, top_p=0.9, seed=123,
                               stop=("\n\n", "END"), stop_token_ids=(5, 6), ignore_eos=True, min_tokens=2)
    q = SamplingParams.from_json({"stop": "###", "ignore_eos": False, "max_tokens": 8.0, "top_k": -1,
                                  "stop_token_ids": 3, "temperature": 1})
    assert q.stop == ("###",) and not q.ignore_eos and q.max_tokens == 8 and q.top_k == 0
    assert q.stop_token_ids == (3,) and q.temperature == 1.0
    assert SamplingParams.from_json({"ignore_eos": "FALSE"}).ignore_eos is False
    assert hash(p) == hash(SamplingParams.from_json(text))


def test_constructor_normalises_sequences() -> None:
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[1])  # type: ignore[arg-type]
    assert p.stop == ("a", "b") and p.stop_token_ids == (1,)
    assert SamplingParams(stop="x").stop == ("x",)  # type: ignore[arg-type]


@pytest.mark.parametrize("payload, field", [
    ('{"max_tokens": 0}', "max_tokens"),
    ('{"max_tokens": -3}', "max_tokens"),
    ('{"max_tokens": 1.5}', "max_tokens"),
    ('{"max_tokens": "ten"}', "max_tokens"),
    ('{"max_tokens": true}', "max_tokens"),
    ('{"temperature": -0.1}', "temperature"),
    ('{"temperature": 100.5}', "temperature"),
    ('{"temperature": "hot"}', "temperature"),
    ('{"temperature": NaN}', "temperature"),
    ('{"temperature": "inf"}', "temperature"),
    ('{"top_k": -2}', "top_k"),
    ('{"top_k": 2.5}', "top_k"),
    ('{"top_p": 0}', "top_p"),
    ('{"top_p": 1.01}', "top_p"),
    ('{"top_p": [0.5]}', "top_p"),
    ('{"seed": -1}', "seed"),
    ('{"seed": 9223372036854775808}', "seed"),
    ('{"stop": ""}', "stop"),
    ('{"stop": ["ok", ""]}', "stop"),
    ('{"stop": ["a", 1]}', "stop"),
    ('{"stop": 5}', "stop"),
    (json.dumps({"stop": [str(i) for i in range(17)]}), "stop"),
    ('{"stop_token_ids": [-1]}', "stop_token_ids"),
    ('{"stop_token_ids": ["x"]}', "stop_token_ids"),
    ('{"ignore_eos": "yes"}', "ignore_eos"),
    ('{"ignore_eos": 1}', "ignore_eos"),
    ('{"min_tokens": 20, "max_tokens": 10}', "min_tokens"),
    ('{"min_tokens": -1}', "min_tokens"),
    ('{"n": 2}', "n"),
    ('{"best_of": 3}', "best_of"),
    ('{"presence_penalty": 0.5}', "presence_penalty"),
    ('{"frequency_penalty": "-1"}', "frequency_penalty"),
    ('{"repetition_penalty": 1.1}', "repetition_penalty"),
    ('{"logprobs": 21}', "logprobs"),
    ('{"logprobs": -1}', "logprobs"),
])
def test_bad_values(payload: str, field: str) -> None:
    with pytest.raises(RequestValidationError) as ei:
        SamplingParams.from_json(payload)
    assert ei.value.field == field
    assert field in str(ei.value)
    assert ei.value.code in ("invalid_argument", "unsupported")


def test_unsupported_is_flagged() -> None:
    with pytest.raises(RequestValidationError, match="not supported") as ei:
        SamplingParams.from_json({"n": 4})
    assert ei.value.code == "unsupported"


def test_unknown_keys_listed() -> None:
    with pytest.raises(RequestValidationError) as ei:
        SamplingParams.from_json('{"temprature": 0.5, "beam_width": 2, "top_k": 3}')
    msg = str(ei.value)
    assert "temprature" in msg and "beam_width" in msg and "supported keys" in msg and "top_p" in msg
    assert ei.value.code == "invalid_argument"


@pytest.mark.parametrize("payload", ['{"max_tokens": 5', "not json", "[1, 2]", '"text"', "42", "null",
                                     b"\xff\xfe{}", b'{"stop": "\xe4\xb8"}'])
def test_bad_documents(payload: str | bytes) -> None:
    with pytest.raises(RequestValidationError, match="sampling_parameters") as ei:
        SamplingParams.from_json(payload)
    assert ei.value.code == "invalid_argument"


def test_max_tokens_limit() -> None:
    assert SamplingParams.from_json('{"max_tokens": 64}', max_tokens_limit=64).max_tokens == 64
    with pytest.raises(RequestValidationError, match="limit of 64"):
        SamplingParams.from_json('{"max_tokens": "65"}', max_tokens_limit=64)


def test_direct_construction_validates() -> None:
    with pytest.raises(RequestValidationError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(RequestValidationError, match="temperature"):
        SamplingParams(temperature=True)  # type: ignore[arg-type]
    assert isinstance(RequestValidationError("x"), ValueError)


# ---- sampler -------------------------------------------------------------------------------------

def test_greedy_is_argmax_first_on_ties() -> None:
    logits = rows(8)
    logits[3, [5, 9]] = 100.0  # tie: the first maximum wins
    params = [SamplingParams()] * 8
    rngs = [np.random.default_rng(0)] * 8
    out = sample(logits, params, rngs)
    assert out.dtype == np.int64 and out.shape == (8,)
    np.testing.assert_array_equal(out, np.argmax(logits, axis=-1))
    assert out[3] == 5


def test_top_k_1_and_tiny_top_p_equal_greedy() -> None:
    logits = rows(16, seed=1, vocab=2000)  # > nucleus probe size too
    want = np.argmax(logits, axis=-1)
    for p in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6),
              SamplingParams(temperature=0.8, top_k=50, top_p=1e-9)):
        rngs = [make_rng(i, np.random.SeedSequence(0)) for i in range(16)]
        np.testing.assert_array_equal(sample(logits, [p] * 16, rngs), want)


def test_seeded_reproducible_and_batch_invariant() -> None:
    row = rows(1, seed=7)[0]
    p = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, seed=1234)

    def run(neighbours: int, position: int, neighbour_seed: int) -> list[int]:
        src = np.random.SeedSequence(neighbour_seed)
        others = rows(neighbours, seed=neighbour_seed)
        nb_params = [SamplingParams(temperature=0.7, seed=None), SamplingParams(), SamplingParams(top_p=0.5,
                     temperature=2.0)]
        batch_params = [nb_params[i % 3] for i in range(neighbours)]
        batch_params.insert(position, p)
        rngs = [make_rng(q.seed, src) for q in batch_params]
        logits = np.insert(others, position, row, axis=0)
        return [int(sample(logits, batch_params, rngs)[position]) for _ in range(30)]

    ref = run(0, 0, 0)
    assert len(set(ref)) > 1  # actually sampling
    assert run(5, 2, 11) == ref
    assert run(9, 9, 99) == ref
    assert run(3, 0, 5) == ref


def test_unseeded_rngs_differ() -> None:
    src = np.random.SeedSequence(0)
    a, b = make_rng(None, src), make_rng(None, src)
    assert a.random() != b.random()
    assert make_rng(5, src).random() == make_rng(5, np.random.SeedSequence(1)).random()


def test_distribution_temperature_one() -> None:
    probs = np.array([0.2, 0.3, 0.5])
    logits = np.tile(np.log(probs).astype(np.float32), (1000, 1))
    p = SamplingParams(temperature=1.0)
    src = np.random.SeedSequence(42)
    rngs = [make_rng(None, src) for _ in range(1000)]
    draws = np.concatenate([sample(logits, [p] * 1000, rngs) for _ in range(20)])
    freq = np.bincount(draws, minlength=3) / draws.size
    np.testing.assert_allclose(freq, probs, atol=0.02)


def test_top_k_top_p_restrict_support() -> None:
    logits = np.log(np.array([[0.1, 0.25, 0.05, 0.6]], dtype=np.float32))
    rng = np.random.default_rng(3)
    k2 = {int(sample(logits, [SamplingParams(temperature=1.0, top_k=2)], [rng])[0]) for _ in range(400)}
    assert k2 == {1, 3}
    p8 = {int(sample(logits, [SamplingParams(temperature=1.0, top_p=0.8)], [rng])[0]) for _ in range(400)}
    assert p8 == {1, 3}  # 0.6 < 0.8 <= 0.85
    p9 = {int(sample(logits, [SamplingParams(temperature=1.0, top_p=0.9)], [rng])[0]) for _ in range(800)}
    assert p9 == {0, 1, 3}


def test_masked_logits_never_drawn() -> None:
    logits = np.full((1, V), -np.inf, dtype=np.float32)
    logits[0, [4, 40]] = [0.0, 1.0]
    rng = np.random.default_rng(0)
    got = {int(sample(logits, [SamplingParams(temperature=3.0)], [rng])[0]) for _ in range(200)}
    assert got == {4, 40}


def test_top_k_ids_match_full_sort() -> None:
    x = rows(1, seed=5, vocab=20000)[0]
    for k in (1, 7, 50, 1250, 1251, 5000, 19999):  # both sides of the subsampling cut-over
        assert set(_top_k_ids(x, k).tolist()) == set(np.argsort(-x)[:k].tolist())


def test_nucleus_matches_full_sort() -> None:
    for seed, top_p in [(0, 0.5), (1, 0.9), (2, 0.99), (3, 0.999)]:
        x = rows(1, seed=seed, vocab=8000)[0]
        w = np.exp(x - x.max())
        order = np.argsort(-w.astype(np.float64), kind="stable")
        cum = np.cumsum(w[order].astype(np.float64))
        keep = int(np.searchsorted(cum, top_p * cum[-1])) + 1
        ids, kept = _nucleus(w, None, top_p)
        assert set(ids.tolist()) == set(order[:keep].tolist())
        np.testing.assert_array_equal(kept, w[ids])
    # Ties at the cut keep the lowest ids; at least one token always survives.
    ids, _ = _nucleus(np.ones(10, np.float32), np.arange(10)[::-1].copy(), 0.35)
    assert sorted(ids.tolist()) == [0, 1, 2, 3]
    assert _nucleus(np.array([1.0, 0.0], np.float32), None, 1e-9)[0].tolist() == [0]


def test_draw_skips_zero_weights_across_blocks() -> None:
    w = np.zeros(3000, np.float32)
    w[[0, 1023, 1024, 2047, 2999]] = [1, 2, 3, 4, 5]
    u = np.random.default_rng(0).random(10000)
    freq = np.bincount([_draw(w, x) for x in u], minlength=3000) / u.size
    np.testing.assert_allclose(freq[[0, 1023, 1024, 2047, 2999]], np.arange(1, 6) / 15, atol=0.015)
    assert freq.sum() == pytest.approx(1.0) and np.count_nonzero(freq) == 5
    assert _draw(w, 0.0) == 0 and _draw(w, float(np.nextafter(1.0, 0.0))) == 2999


def test_shape_errors() -> None:
    with pytest.raises(ValueError):
        sample(np.zeros(V, np.float32), [SamplingParams()], [np.random.default_rng()])
    with pytest.raises(ValueError):
        sample(np.zeros((2, V), np.float32), [SamplingParams()], [np.random.default_rng()])
