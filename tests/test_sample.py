"""Samplers: greedy, top-k, top-p, seeds."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlxc.runtime.serving.sample import make_sampler

# A crafted distribution over 8 tokens, probabilities 0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015,
# 0.005 in a shuffled order, for two rows (the second reversed).
PROBS = np.array([0.1, 0.4, 0.005, 0.15, 0.03, 0.25, 0.015, 0.05])
LOGITS = mx.array(np.log(np.stack([PROBS, PROBS[::-1]])), dtype=mx.float32)
BY_RANK = [np.argsort(-PROBS), np.argsort(-PROBS[::-1])]  # token ids, most likely first


def draws(sampler, n=400) -> np.ndarray:
    """n draws for both rows at once: shape [n, 2]."""
    return np.array(sampler(mx.tile(LOGITS, (n, 1)))).reshape(n, 2)


def test_greedy_is_argmax():
    out = make_sampler()(LOGITS)
    assert out.dtype == mx.int32
    assert out.tolist() == [int(BY_RANK[0][0]), int(BY_RANK[1][0])]


@pytest.mark.parametrize("temp", [0.5, 1.0, 5.0])
def test_top_k_one_is_greedy(temp):
    greedy = make_sampler()(LOGITS).tolist()
    assert (draws(make_sampler(temp=temp, top_k=1, seed=1)) == greedy).all()


def test_tiny_top_p_is_greedy():
    greedy = make_sampler()(LOGITS).tolist()
    assert (draws(make_sampler(temp=2.0, top_p=1e-6, seed=2)) == greedy).all()


def test_seed_makes_draws_repeatable():
    a = draws(make_sampler(temp=1.0, seed=7))
    b = draws(make_sampler(temp=1.0, seed=7))
    c = draws(make_sampler(temp=1.0, seed=8))
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    # The sampler owns its key: seeding the global generator in between changes nothing.
    sampler = make_sampler(temp=1.0, seed=7)
    first = draws(sampler, 50)
    mx.random.seed(123)
    second = draws(sampler, 50)
    again = make_sampler(temp=1.0, seed=7)
    np.testing.assert_array_equal(draws(again, 50), first)
    mx.random.seed(999)
    np.testing.assert_array_equal(draws(again, 50), second)


@pytest.mark.parametrize(
    ("top_k", "top_p", "allowed"),
    [
        (3, 1.0, 3),  # top-3
        (0, 0.6, 2),  # 0.4 + 0.25 reaches 0.6
        (0, 0.64, 2),
        (0, 0.7, 3),
        (4, 0.9, 4),  # top-p would keep 5; top-k caps it at 4
    ],
)
def test_samples_come_only_from_the_allowed_set(top_k, top_p, allowed):
    out = draws(make_sampler(temp=1.0, top_k=top_k, top_p=top_p, seed=3), n=2000)
    for row in range(2):
        seen = set(out[:, row].tolist())
        expected = set(BY_RANK[row][:allowed].tolist())
        assert seen == expected  # nothing outside, and 2000 draws hit every allowed token


def test_unfiltered_sampling_follows_the_distribution():
    out = draws(make_sampler(temp=1.0, seed=4), n=4000)[:, 0]
    freq = np.bincount(out, minlength=8) / len(out)
    assert np.abs(freq - PROBS).max() < 0.03


def test_temperature_sharpens():
    cold = draws(make_sampler(temp=0.2, seed=5), n=1000)[:, 0]
    top = int(BY_RANK[0][0])
    # p(top) at temp 0.2 is 0.4^5 / sum p^5: nearly 0.9.
    expected = 0.4**5 / sum(p**5 for p in PROBS)
    assert math.isclose((cold == top).mean(), expected, abs_tol=0.05)


def test_bad_arguments():
    for kwargs in ({"temp": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -1}):
        with pytest.raises(ValueError):
            make_sampler(**kwargs)
