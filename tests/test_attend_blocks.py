"""A long chunk under the causal mask on the CPU attends in blocks of queries
(``layers.CAUSAL_BLOCK``), each against the keys up to its last query: the same output as MLX's
attention over the whole chunk, for a first chunk and one after earlier tokens, GQA, a value
head dim other than the keys' (MLA), and learned sinks (gpt-oss). A model prefilling 150 tokens
in one chunk (three blocks) is checked against transformers in ``test_logits``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxc.runtime.model import layers


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("n_queries, n_keys", [(65, 65), (150, 150), (150, 211), (128, 300)])
@pytest.mark.parametrize("value_dim, sinks", [(32, False), (24, False), (32, True)])
def test_causal_blocks_equal_one_pass(rng, monkeypatch, n_queries, n_keys, value_dim, sinks):
    calls = []
    real = mx.fast.scaled_dot_product_attention

    def counted(q, *args, **kwargs):
        calls.append(q.shape[-2])
        return real(q, *args, **kwargs)

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    q, k, v = normal(2, 8, n_queries, 32), normal(2, 2, n_keys, 32), normal(2, 2, n_keys, value_dim)
    sink = normal(8) if sinks else None
    want = real(q, k, v, scale=0.2, mask="causal", sinks=sink)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", counted)
    got = layers.attend(q, k, v, scale=0.2, mask="causal", sinks=sink)
    blocks = -(-n_queries // layers.CAUSAL_BLOCK)
    assert calls == [layers.CAUSAL_BLOCK] * (blocks - 1) + [
        n_queries - layers.CAUSAL_BLOCK * (blocks - 1)
    ]
    # The same float32 sums per score; a block's softmax runs over fewer (masked) columns.
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("on_cpu")
def test_short_chunks_and_other_masks_take_one_pass(rng, monkeypatch):
    """A chunk of one block, and a mask given as an array (a window here; an array may also let
    a query see later keys, as Gemma 3's image spans do), go to MLX whole."""
    calls = []
    real = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(
        mx.fast,
        "scaled_dot_product_attention",
        lambda q, *a, **kw: calls.append(q.shape[-2]) or real(q, *a, **kw),
    )
    q = mx.array(rng.standard_normal((1, 2, 100, 16)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, 100, 16)).astype(np.float32))
    layers.attend(q[:, :, -64:], k, k, scale=0.25, mask="causal")  # one block's worth
    window = mx.arange(100)[None, :] > mx.arange(100)[:, None] - 8
    layers.attend(
        q, k, k, scale=0.25, mask=window & (mx.arange(100)[None, :] <= mx.arange(100)[:, None])
    )
    assert calls == [64, 100]
