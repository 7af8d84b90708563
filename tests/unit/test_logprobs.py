"""Token logprobs: the sampler's contract, the sampling parameter, the serving events, the Triton JSON."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import numpy as np
import pytest

from builder.checkpoint import Checkpoint, load_weights
from deploy.triton_adapter import NEG_INF_LOGPROB, LogprobsEncoder, token_text
from hybrid_runtime.reference import forward
from hybrid_runtime.sampler import TokenLogprobs, sample, token_logprobs
from hybrid_runtime.sampling import MAX_LOGPROBS, RequestValidationError, SamplingParams
from hybrid_runtime.serving import Event, GenerationRequest, RuntimeOptions, ServingEngine, generate
from hybrid_runtime.tokenizer import Tokenizer


def _log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_matches_log_softmax_of_the_raw_logits_in_float64() -> None:
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((5, 3000)) * 4).astype(np.float32)
    tokens = np.array([3, 2999, 0, 1234, 7])
    out = token_logprobs(logits, tokens, [0, 5, 20, -1, 1])
    ref = _log_softmax64(logits)
    assert out[3] is None
    for b in (0, 1, 2, 4):
        lp = out[b]
        assert isinstance(lp, TokenLogprobs)
        assert lp.logprob == pytest.approx(ref[b, tokens[b]], abs=1e-12)
        n = [0, 5, 20, -1, 1][b]
        order = np.argsort(-ref[b], kind="stable")[:n]
        assert [t for t, _ in lp.top] == order.tolist()
        assert [v for _, v in lp.top] == pytest.approx(ref[b, order].tolist(), abs=1e-12)
    assert out[0].top == ()
    # The distribution is normalised: exp(logprobs) over the whole vocabulary sums to 1.
    full = token_logprobs(logits[:1], np.arange(1), [MAX_LOGPROBS])[0]
    assert math.fsum(math.exp(v) for v in ref[0]) == pytest.approx(1.0, abs=1e-12)
    assert full.top[0][1] == pytest.approx(ref[0].max(), abs=1e-12)


def test_independent_of_how_the_token_was_sampled() -> None:
    """Raw logits: temperature / top-k / top-p change which token is drawn, never its reported logprob."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((1, 500)).astype(np.float32) * 3
    ref = _log_softmax64(logits)[0]
    for params in (SamplingParams(temperature=0.3, top_k=5, seed=1), SamplingParams(temperature=2.0, top_p=0.5,
                                                                                     seed=2)):
        tok = sample(logits, [params], [np.random.default_rng(params.seed)])
        lp = token_logprobs(logits, tok, [3])[0]
        assert lp.logprob == pytest.approx(ref[int(tok[0])], abs=1e-12)
        assert lp.top == token_logprobs(logits, np.array([0]), [3])[0].top


def test_ties_sorted_by_lower_id_and_masked_logits() -> None:
    logits = np.full((1, 64), -np.inf, dtype=np.float32)
    logits[0, [40, 7, 21, 3]] = [2.0, 2.0, 2.0, 1.0]
    lp = token_logprobs(logits, np.array([21]), [4])[0]
    assert [t for t, _ in lp.top] == [7, 21, 40, 3]
    assert lp.top[0][1] == lp.top[1][1] == lp.top[2][1] == pytest.approx(lp.logprob)
    # Only 4 finite logits: the 5th..20th most likely tokens are -inf, lowest ids first.
    more = token_logprobs(logits, np.array([3]), [6])[0]
    assert [t for t, _ in more.top] == [7, 21, 40, 3, 0, 1]
    assert more.top[-1][1] == -np.inf
    nan = logits.copy()
    nan[0, 5] = np.nan  # NaN counts as -inf, as in sample()
    assert token_logprobs(nan, np.array([21]), [0])[0].logprob == pytest.approx(lp.logprob)


def test_degenerate_rows() -> None:
    masked = np.full((1, 8), -np.inf, dtype=np.float32)
    assert token_logprobs(masked, np.array([2]), [0])[0].logprob == pytest.approx(-math.log(8))
    inf = np.zeros((1, 8), dtype=np.float32)
    inf[0, [1, 6]] = np.inf
    out = token_logprobs(inf, np.array([6]), [3])[0]
    assert out.logprob == pytest.approx(-math.log(2)) and [t for t, _ in out.top] == [1, 6, 0]
    assert out.top[2][1] == -np.inf


def test_shape_and_range_errors() -> None:
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        token_logprobs(np.zeros(4, dtype=np.float32), np.array([0]), [0])
    with pytest.raises(ValueError, match="one token and one top_n"):
        token_logprobs(np.zeros((2, 4), dtype=np.float32), np.array([0]), [0, 0])
    with pytest.raises(ValueError, match="exceeds 20"):
        token_logprobs(np.zeros((1, 40), dtype=np.float32), np.array([0]), [21])


@pytest.mark.parametrize(("value", "expect"), [(None, None), (0, 0), (5, 5), ("3", 3), (20, 20)])
def test_sampling_parameter(value: object, expect: int | None) -> None:
    assert SamplingParams.from_json({"logprobs": value}).logprobs == expect


@pytest.mark.parametrize("value", [21, -1, 2.5, True, "many", [1]])
def test_sampling_parameter_rejects(value: object) -> None:
    with pytest.raises(RequestValidationError, match="logprobs") as ei:
        SamplingParams.from_json({"logprobs": value})
    assert ei.value.field == "logprobs"
    with pytest.raises(RequestValidationError, match="logprobs"):
        SamplingParams(logprobs=value)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(default_bundle: Path):
    eng = ServingEngine(default_bundle, RuntimeOptions()).start()
    yield eng
    eng.shutdown()


def test_served_logprobs_equal_the_reference_forward(engine: ServingEngine, default_checkpoint: Path) -> None:
    """Batched with requests that ask for none, each token's logprob is the reference model's log-softmax."""
    ids = (5, 17, 300, 42, 9, 1000, 77)
    asks = GenerationRequest("lp", prompt_ids=ids, params=SamplingParams(max_tokens=10, ignore_eos=True,
                                                                         logprobs=4))
    sampled = GenerationRequest("lp-sampled", prompt_ids=ids, params=SamplingParams(
        max_tokens=10, ignore_eos=True, temperature=1.0, seed=3, logprobs=0))
    plain = [GenerationRequest(f"plain{i}", prompt_ids=(i + 3, 8, 9), params=SamplingParams(max_tokens=10,
                                                                                           ignore_eos=True))
             for i in range(3)]
    finals = generate(engine, [asks, sampled, *plain])
    assert all(f.logprobs == () for f in finals[2:])
    ck = Checkpoint(default_checkpoint)
    w = load_weights(ck)
    for final, top_n in ((finals[0], 4), (finals[1], 0)):
        out = list(final.output_ids)
        assert len(final.logprobs) == len(out) == 10
        ref = _log_softmax64(forward(ck.config, w, np.array(list(ids) + out[:-1]))[len(ids) - 1:])
        for i, (tok, lp) in enumerate(zip(out, final.logprobs)):
            assert lp.logprob == pytest.approx(ref[i, tok], abs=2e-4)
            assert len(lp.top) == top_n
            if top_n:
                assert lp.top[0][0] == tok  # greedy: the sampled token is the most likely one
                assert [t for t, _ in lp.top] == np.argsort(-ref[i], kind="stable")[:top_n].tolist()
    # Token events carry one entry per token; the final one covers every generated id.
    done = threading.Event()

    def sink(ev: Event) -> None:
        events.append(ev)
        if ev.final:
            done.set()

    events: list[Event] = []
    engine.submit(GenerationRequest("ev", prompt_ids=ids, params=asks.params), sink)
    assert done.wait(60)
    tokens = [e for e in events if not e.final]
    assert tokens and all(len(e.logprobs) == len(e.token_ids) == 1 for e in tokens)
    assert [lp for e in tokens for lp in e.logprobs] == list(events[-1].logprobs[:len(tokens)])
    # Alone rather than batched: the same tokens; logits differ by float rounding of other batch shapes only.
    def top_ids(lps: tuple[TokenLogprobs, ...]) -> list[list[int]]:
        return [[t for t, _ in lp.top] for lp in lps]

    assert top_ids(events[-1].logprobs) == top_ids(finals[0].logprobs)
    assert [lp.logprob for lp in events[-1].logprobs] == pytest.approx([lp.logprob for lp in finals[0].logprobs],
                                                                       abs=1e-4)


def test_a_stop_token_gets_its_logprob_on_the_final_event(engine: ServingEngine) -> None:
    ids = (5, 17, 300)
    ref = generate(engine, [GenerationRequest("r", prompt_ids=ids, params=SamplingParams(
        max_tokens=3, ignore_eos=True))])[0].output_ids
    # Make the 2nd generated token a stop id (the EOS path): it has no token event, but its logprob is on
    # the final event, next to its id.
    stop = generate(engine, [GenerationRequest("s", prompt_ids=ids, params=SamplingParams(
        max_tokens=3, stop_token_ids=(ref[1],), logprobs=1))])[0]
    assert stop.finish_reason == "stop" and stop.output_ids == ref[:2] and len(stop.logprobs) == 2
    assert stop.logprobs[1].top[0][0] == ref[1]


def test_triton_json_of_logprobs(default_bundle: Path) -> None:
    tok = Tokenizer.from_dir(default_bundle)
    enc = LogprobsEncoder(tok.token_bytes)
    ids = tok.encode("café 🙂")
    lps = [TokenLogprobs(-0.5 - i, ((ids[i], -0.5 - i), (0, -np.inf))) for i in range(len(ids))]
    doc = json.loads(enc.encode(ids, lps))
    assert [d["token_id"] for d in doc] == ids
    assert b"".join(bytes(d["bytes"]) for d in doc).decode() == "café 🙂"
    assert [d["token"] for d in doc] == [token_text(bytes(d["bytes"])) for d in doc]
    assert any(d["token"].startswith("bytes:\\x") for d in doc)  # the emoji is split over byte tokens
    assert doc[0]["logprob"] == -0.5 and doc[0]["top_logprobs"][1] == {
        "token_id": 0, "token": "<|endoftext|>", "bytes": list(b"<|endoftext|>"), "logprob": NEG_INF_LOGPROB}
    with pytest.raises(ValueError, match="2 ids but 1 logprobs"):
        enc.encode(ids[:2], lps[:1])
