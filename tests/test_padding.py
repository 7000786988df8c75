"""A batch of prompts of different lengths, left-padded with an attention_mask, on text models:
logits of the real tokens equal transformers' (float32, atol 1e-4), through prefill chunks,
decode steps and a trim; the pads never act as keys."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from checkpoints import make_llama, make_qwen3
from transformers import AutoModelForCausalLM

import mlxc
from mlxc.runtime.cache import enforce_max_kv

ATOL = 1e-4


def padded_batch(rng, lengths, vocab=300):
    n = max(lengths)
    ids = np.zeros((len(lengths), n), np.int64)
    mask = np.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, n - length :] = rng.integers(3, vocab, length)
        mask[row, n - length :] = 1
    return ids, mask


@pytest.mark.parametrize("make", [make_llama, make_qwen3], ids=["llama", "qwen3"])
def test_left_padded_batch_matches_transformers(make, tmp_path):
    make(tmp_path, tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    rng = np.random.default_rng(0)
    ids, mask = padded_batch(rng, [17, 9, 12])
    steps = rng.integers(3, 300, (3, 4))
    full_ids = np.concatenate([ids, steps], axis=1)
    full_mask = np.concatenate([mask, np.ones_like(steps)], axis=1)
    with torch.no_grad():
        want = hf(
            input_ids=torch.from_numpy(full_ids), attention_mask=torch.from_numpy(full_mask)
        ).logits.numpy()

    model = mlxc.load_model(tmp_path)
    cache = model.make_cache()
    parts = [np.array(model(mx.array(ids[:, :8]), cache=cache, attention_mask=mx.array(mask)))]
    parts.append(np.array(model(mx.array(ids[:, 8:]), cache=cache)))
    for t in range(steps.shape[1]):
        parts.append(np.array(model(mx.array(steps[:, t : t + 1]), cache=cache)))
    got = np.concatenate(parts, axis=1)
    real = full_mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=ATOL, rtol=0)
    assert np.isfinite(got).all()  # pad rows too: they attend to themselves


def test_padding_survives_a_trim_and_masks_stay_sized_to_live_keys(tmp_path):
    make_llama(tmp_path, tokenizer=False)
    model = mlxc.load_model(tmp_path)
    ids, mask = padded_batch(np.random.default_rng(1), [20, 6])
    cache = model.make_cache()
    model(mx.array(ids[:, :10]), cache=cache, attention_mask=mx.array(mask))
    enforce_max_kv(cache, 8, keep=2)  # drops some of row 1's pads, keeps 2 at the front
    out = model(mx.array(ids[:, 10:]), cache=cache)
    assert np.isfinite(np.array(out)).all()
    valid = np.array(cache[0].key_valid())[:, 0, 0]
    # Absolute positions of the live keys: 0, 1 (sink), then 4..19; row 1's pads are 0..13.
    assert valid.shape == (2, cache[0].live_len)
    assert valid[0].all()
    assert valid[1].tolist() == [False, False] + [p >= 14 for p in range(4, 20)]


def test_attention_mask_must_pad_on_the_left_and_come_first(tmp_path):
    make_llama(tmp_path, tokenizer=False)
    model = mlxc.load_model(tmp_path)
    ids = mx.array([[5, 6, 7], [5, 6, 7]])
    with pytest.raises(ValueError, match="pad on the left"):
        model(ids, attention_mask=mx.array([[1, 1, 1], [1, 1, 0]]))
    cache = model.make_cache()
    model(ids, cache=cache)
    with pytest.raises(ValueError, match="first chunk"):
        model(ids, cache=cache, attention_mask=mx.array([[1, 1, 1], [0, 1, 1]]))


def test_last_only_projects_just_the_last_position(tmp_path):
    make_qwen3(tmp_path, tokenizer=False)
    model = mlxc.load_model(tmp_path)
    ids = mx.array(np.random.default_rng(3).integers(3, 300, (2, 11)))
    full = model(ids)
    last = model(ids, last_only=True)
    assert last.shape == (2, 1, full.shape[-1])
    np.testing.assert_allclose(np.array(last), np.array(full[:, -1:]), atol=1e-5, rtol=0)
