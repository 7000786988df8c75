"""The batched sampler's controls (runtime.serving.sample) against reference computations:
transformers' logits processors (repetition penalty, temperature, top-k, top-p, min-p) on the
same logits, OpenAI's presence/frequency formula and logit bias in numpy, log-probabilities as a
log-softmax; rows of one batch with different parameters as each alone."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from mlxc.runtime.serving.sample import (
    RowSampler,
    SamplingOptions,
    adjust_logits,
    make_sampler,
    sample_rows,
    warp_logits,
)

V = 64
RNG = np.random.default_rng(0)
PROMPT = [3, 5, 5, 9, 17]
OUTPUT = [5, 40, 40, 40, 2]  # tokens the row "generated" (forced below)


def force(row: RowSampler, tokens: list[int]) -> None:
    """Feed ``row`` these generated tokens through sample_rows (a one-hot logit dominates
    whatever the row's penalties do to it)."""
    for t in tokens:
        logits = np.full((1, V), -30.0, np.float32)
        logits[0, t] = 1e4
        got = sample_rows(mx.array(logits), [row])
        mx.eval(got.arrays())
        assert got.tokens.tolist() == [t]


def random_logits(rows: int = 1) -> np.ndarray:
    return (RNG.standard_normal((rows, V)) * 3).astype(np.float32)


def with_history(**options) -> RowSampler:
    row = RowSampler(SamplingOptions(**options), PROMPT)
    force(row, OUTPUT)
    return row


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty):
    row = with_history(repetition_penalty=penalty)
    logits = random_logits()
    got = np.array(adjust_logits(mx.array(logits), [row]))
    ids = torch.tensor([PROMPT + OUTPUT])
    want = RepetitionPenaltyLogitsProcessor(penalty)(ids, torch.tensor(logits)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert (got != logits).sum() > 0


def test_presence_frequency_and_logit_bias_match_openai_formula():
    bias = ((7, 5.0), (40, -100.0), (63, 2.5))
    row = with_history(presence_penalty=0.8, frequency_penalty=0.5, logit_bias=bias)
    logits = random_logits()
    got = np.array(adjust_logits(mx.array(logits), [row]))
    counts = np.bincount(OUTPUT, minlength=V)  # output tokens only, not the prompt
    want = logits[0] - counts * 0.5 - (counts > 0) * 0.8
    for t, b in bias:
        want[t] += b
    np.testing.assert_allclose(got[0], want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(
    "temp, top_k, top_p, min_p",
    [(0.7, 10, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.1), (0.9, 20, 0.9, 0.05)],
)
def test_warpers_match_transformers(temp, top_k, top_p, min_p):
    logits = random_logits(2)
    row = RowSampler(SamplingOptions(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p))
    got = np.array(warp_logits(mx.array(logits), [row, row]))
    want = torch.tensor(logits)
    warpers = [TemperatureLogitsWarper(temp)]
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    warpers += [MinPLogitsWarper(min_p)] if min_p else []
    for w in warpers:
        want = w(None, want)
    want = want.numpy()
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    kept = ~np.isinf(want)
    np.testing.assert_allclose(got[kept], want[kept], rtol=1e-5, atol=1e-5)
    assert kept.sum() < want.size or (top_k == 0 and top_p == 1 and min_p == 0)


def test_rows_of_one_batch_are_sampled_as_each_alone():
    options = [
        SamplingOptions(),  # greedy, nothing else: untouched
        SamplingOptions(repetition_penalty=1.5, top_k=5, temperature=0.8, seed=3),
        SamplingOptions(temperature=1.2, top_p=0.7, min_p=0.05, frequency_penalty=1.0, seed=4),
        SamplingOptions(presence_penalty=1.5, logit_bias=((0, 3.0),)),
    ]
    steps = [random_logits(len(options)) for _ in range(6)]
    batch = [RowSampler(o, PROMPT) for o in options]
    alone = [RowSampler(o, PROMPT) for o in options]
    for logits in steps:
        adjusted = np.array(adjust_logits(mx.array(logits), batch))
        np.testing.assert_array_equal(adjusted[0], logits[0])  # no penalty: not touched
        for b, row in enumerate(alone):
            one = np.array(adjust_logits(mx.array(logits[b : b + 1]), [row]))
            np.testing.assert_allclose(adjusted[b], one[0], rtol=1e-6)
        got = sample_rows(mx.array(logits), batch)
        mx.eval(got.arrays())
        want = [sample_rows(mx.array(logits[b : b + 1]), [r]) for b, r in enumerate(alone)]
        assert got.tokens.tolist() == [w.tokens.item() for w in want]


def test_penalties_push_repeats_down():
    """A penalised greedy row stops repeating the token that a plain greedy row repeats."""
    logits = random_logits()
    top = int(logits.argmax())
    plain = RowSampler(SamplingOptions(), PROMPT)
    penalised = RowSampler(SamplingOptions(frequency_penalty=2.0, presence_penalty=2.0))
    seen = {"plain": [], "penalised": []}
    for _ in range(6):
        got = sample_rows(mx.array(np.concatenate([logits, logits])), [plain, penalised])
        mx.eval(got.arrays())
        a, b = got.tokens.tolist()
        seen["plain"].append(a)
        seen["penalised"].append(b)
    assert seen["plain"] == [top] * 6
    assert len(set(seen["penalised"])) == 6  # each repeat costs its logit 2 + 2 per use


def test_logprobs_are_the_models_log_softmax():
    logits = random_logits(2)
    rows = [
        RowSampler(SamplingOptions(logprobs=True, top_logprobs=5, repetition_penalty=2.0)),
        RowSampler(SamplingOptions(logprobs=True, top_logprobs=3, temperature=1.0, seed=1)),
    ]
    got = sample_rows(mx.array(logits), rows)
    mx.eval(got.arrays())
    lp = torch.log_softmax(torch.tensor(logits), -1).numpy()
    tokens = got.tokens.tolist()
    np.testing.assert_allclose(got.logprobs.tolist(), lp[[0, 1], tokens], atol=1e-5)
    top_ids, top_lp = np.array(got.top_ids), np.array(got.top_logprobs)
    for b in range(2):
        np.testing.assert_array_equal(top_ids[b], np.argsort(-lp[b])[:5])
        np.testing.assert_allclose(top_lp[b], np.sort(lp[b])[::-1][:5], atol=1e-5)
    assert tokens[0] == int(logits[0].argmax())  # greedy: the top logprob


def test_rows_without_logprobs_pay_nothing_and_validation():
    got = sample_rows(mx.array(random_logits(2)), [RowSampler(SamplingOptions())] * 2)
    assert got.logprobs is None and got.top_ids is None and got.state == []
    assert make_sampler(temp=1.0, min_p=0.5, seed=1)(mx.array(random_logits(3))).shape == (3,)
    for bad in (
        {"min_p": 1.5},
        {"repetition_penalty": 0.0},
        {"top_logprobs": 21},
        {"top_p": 0.0},
    ):
        with pytest.raises(ValueError):
            RowSampler(SamplingOptions(**bad))
