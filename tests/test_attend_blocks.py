"""A long chunk under the causal mask on the CPU attends in blocks of queries
(``layers.CAUSAL_BLOCK``), each against the keys up to its last query and composed with a
polynomial exp (``layers.composed_attention``'s CPU form): the same output as MLX's fused
attention over the whole chunk, for a first chunk and one after earlier tokens, GQA, a value
head dim other than the keys' (MLA), and learned sinks (gpt-oss). Decode steps and
verifications take the composed form in one call, any mask; many blocks against many keys
keep MLX's kernel. Under a sliding window
(``masks.Window``, what ``masks.causal`` gives on the CPU) each block also starts at its first
query's window. A model prefilling 150 tokens in one chunk (three blocks) is checked against
transformers in ``test_logits``, Gemma 3 past its window in ``test_gemma3``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxc.runtime.model import layers, masks


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("n_queries, n_keys", [(65, 65), (150, 150), (150, 211), (128, 300)])
@pytest.mark.parametrize("value_dim, sinks", [(32, False), (24, False), (32, True)])
def test_causal_blocks_equal_one_pass(rng, monkeypatch, n_queries, n_keys, value_dim, sinks):
    calls = []
    block = layers.composed_attention

    def counted(q, *args, **kwargs):
        calls.append(q.shape[-2])
        return block(q, *args, **kwargs)

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    q, k, v = normal(2, 8, n_queries, 32), normal(2, 2, n_keys, 32), normal(2, 2, n_keys, value_dim)
    sink = normal(8) if sinks else None
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal", sinks=sink)
    monkeypatch.setattr(layers, "composed_attention", counted)
    got = layers.attend(q, k, v, scale=0.2, mask="causal", sinks=sink)
    blocks = -(-n_queries // layers.CAUSAL_BLOCK)
    assert calls == [layers.CAUSAL_BLOCK] * (blocks - 1) + [
        n_queries - layers.CAUSAL_BLOCK * (blocks - 1)
    ]
    # float32 throughout; the polynomial exp is within 2e-6 of MLX's (relative).
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=2e-6)


def _counting(monkeypatch, calls: dict) -> None:
    """Record the query count of each composed and each fused attention call."""
    composed, fused = layers.composed_attention, mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(
        layers,
        "composed_attention",
        lambda q, *a, **kw: calls["composed"].append(q.shape[-2]) or composed(q, *a, **kw),
    )
    monkeypatch.setattr(
        mx.fast,
        "scaled_dot_product_attention",
        lambda q, *a, **kw: calls["fused"].append(q.shape[-2]) or fused(q, *a, **kw),
    )


@pytest.mark.usefixtures("on_cpu")
def test_short_chunks_and_other_masks_take_one_pass(rng, monkeypatch):
    """A chunk of one block's worth attends composed in one call; a longer one with a mask
    given as an array (a window here; an array may also let a query see later keys, as Gemma
    3's image spans do) goes to MLX whole."""
    calls = {"composed": [], "fused": []}
    _counting(monkeypatch, calls)
    q = mx.array(rng.standard_normal((1, 2, 100, 16)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, 100, 16)).astype(np.float32))
    layers.attend(q[:, :, -64:], k, k, scale=0.25, mask="causal")  # one block's worth
    window = mx.arange(100)[None, :] > mx.arange(100)[:, None] - 8
    layers.attend(
        q, k, k, scale=0.25, mask=window & (mx.arange(100)[None, :] <= mx.arange(100)[:, None])
    )
    assert calls == {"composed": [64], "fused": [100]}


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("n_queries", [1, 5])
@pytest.mark.parametrize("mask_kind", ["none", "rows", "causal"])
@pytest.mark.parametrize("sinks", [False, True])
def test_decode_steps_and_verifications_attend_composed(
    rng, monkeypatch, n_queries, mask_kind, sinks
):
    """A decode step or a verification (a few queries) on the CPU attends in one composed call,
    with no mask, a batch's per-row key mask (``[B, 1, L, T]``: padding and trimmed columns
    False) or a causal one, GQA and sinks: MLX's fused attention's output."""

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    B, T = 3, 300
    q, k, v = normal(B, 8, n_queries, 32), normal(B, 2, T, 32), normal(B, 2, T, 24)
    sink = normal(8) if sinks else None
    valid = np.repeat(rng.random((B, 1, 1, T)) > 0.3, n_queries, axis=2)  # [B, 1, L, T]
    valid[..., -n_queries:] = np.tril(np.ones((n_queries, n_queries), bool))  # its own, causal
    mask = {"none": None, "rows": mx.array(valid), "causal": "causal"}[mask_kind]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask, sinks=sink)
    calls = {"composed": [], "fused": []}
    _counting(monkeypatch, calls)
    got = layers.attend(q, k, v, scale=0.2, mask=mask, sinks=sink)
    assert calls == {"composed": [n_queries], "fused": []}
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=2e-6)


@pytest.mark.usefixtures("on_cpu")
def test_many_blocks_against_many_keys_keep_the_fused_kernel(rng, monkeypatch):
    """Past CPU_SCORES a block of queries would reread too many keys: a chunk of 128 queries
    after 16k tokens attends through MLX's kernel, in blocks of CAUSAL_BLOCK."""
    q = mx.array(rng.standard_normal((1, 8, 128, 16)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, 16_384, 16)).astype(np.float32))
    calls = {"composed": [], "fused": []}
    _counting(monkeypatch, calls)
    layers.attend(q, k, k, scale=0.25, mask="causal")
    assert calls == {"composed": [], "fused": [layers.CAUSAL_BLOCK] * 2}


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize(
    "n_queries, n_keys, window",
    [(150, 150, 32), (150, 150, 100), (128, 300, 20), (200, 260, 64), (65, 400, 1)],
)
@pytest.mark.parametrize("sinks", [False, True])
def test_window_blocks_equal_one_pass(rng, monkeypatch, n_queries, n_keys, window, sinks):
    """Each block attends only from its first query's window to its last query; the output is
    MLX's over the whole chunk with the window's boolean mask."""
    seen = []
    block = layers.composed_attention

    def counted(q, k, *args, **kwargs):
        seen.append((q.shape[-2], k.shape[-2]))
        return block(q, k, *args, **kwargs)

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    q, k, v = normal(1, 4, n_queries, 32), normal(1, 2, n_keys, 32), normal(1, 2, n_keys, 32)
    sink = normal(4) if sinks else None
    mask = masks.causal(n_queries, n_keys, window=window)
    assert isinstance(mask, masks.Window)
    want = mx.fast.scaled_dot_product_attention(
        q, k, v, scale=0.2, mask=masks.causal_array(n_queries, n_keys, window), sinks=sink
    )
    monkeypatch.setattr(layers, "composed_attention", counted)
    got = layers.attend(q, k, v, scale=0.2, mask=mask, sinks=sink)
    size = layers.CAUSAL_BLOCK
    assert [n for n, _ in seen] == [min(size, n_queries - a) for a in range(0, n_queries, size)]
    # A block of b queries sees at most its own b keys and the window - 1 before its first.
    assert all(keys <= n + window - 1 for n, keys in seen)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=2e-6)


@pytest.mark.usefixtures("on_cpu")
def test_a_window_mask_is_built_where_it_is_not_blocked(rng):
    """A chunk of one block's worth of queries reads the window's boolean array (built once),
    and so does Gemma 3's image overlay; a decode step's mask and every mask under ``mlxc
    verify``'s audit are built by ``masks.causal`` itself."""
    from mlxc.runtime.model import image_attention

    mask = masks.causal(40, 100, window=16)
    assert isinstance(mask, masks.Window)
    q = mx.array(rng.standard_normal((1, 2, 40, 16)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, 100, 16)).astype(np.float32))
    got = layers.attend(q, k, k, scale=0.25, mask=mask)
    want = mx.fast.scaled_dot_product_attention(
        q, k, k, scale=0.25, mask=masks.causal_array(40, 100, 16)
    )
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-6)
    assert mask.array() is mask.array()
    is_image = mx.array([[0] * 10 + [1] * 20 + [0] * 10])
    overlaid = image_attention.with_images(mask, is_image, 100, 16)
    expected = masks.causal_array(40, 100, 16) | image_attention.overlay(is_image, 100, 16)
    assert mx.array_equal(overlaid, expected).item()
    assert isinstance(masks.causal(1, 100, window=16), mx.array)
    with masks.array_masks():
        assert isinstance(masks.causal(40, 100, window=16), mx.array)
