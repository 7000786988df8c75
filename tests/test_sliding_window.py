"""The windowed-KV cache kind: a sliding-window layer keeps only what its window can see, alone
and as rows of the server's decode batch, and attention over it equals attention over every key
with the window mask. Then mistral (the llama spec) with a sliding window against transformers.
(gemma3_text, ministral3 and gpt_oss test their own windows against transformers.)"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import checkpoints as ckpt

import mlxc
from mlxc.runtime.model import masks
from mlxc.runtime.model.batch import BatchKVCache, BatchWindowedKVCache
from mlxc.runtime.model.cache import KVCache, LayerCache, WindowedKVCache, enforce_max_kv
from mlxc.runtime.model.layers import attend

H, D, W = 2, 4, 5


def kv(rng, n: int, batch: int = 1) -> tuple[mx.array, mx.array]:
    k = rng.standard_normal((batch, H, n, D)).astype(np.float32)
    return mx.array(k), mx.array(-k)


@pytest.mark.parametrize("chunk", [1, 3, 4, 5, 7, 20])
def test_attention_over_the_window_equals_attention_over_every_key(rng, chunk):
    """Chunks shorter than, equal to and longer than the window: the windowed cache and the
    window mask sized from its live_len give what a full cache gives with the window mask."""
    windowed, full = WindowedKVCache(W), KVCache()
    for start in range(0, 60, chunk):
        k, v = kv(rng, chunk)
        q = mx.array(rng.standard_normal((1, H, chunk, D)).astype(np.float32))
        outs = []
        for cache in (windowed, full):
            mask = masks.causal(chunk, cache.live_len + chunk, window=W)
            keys, values = cache.update_and_fetch(k, v)
            outs.append(np.array(attend(q, keys, values, scale=0.5, mask=mask)))
        np.testing.assert_allclose(outs[0], outs[1], atol=1e-6)
        assert windowed.offset == full.offset == start + chunk  # positions stay monotonic
        # Between forwards: live, what the next query may see; held, below window - 1 + slack.
        assert windowed.live_len == min(W - 1, windowed.offset)
        assert windowed.live_len <= windowed.held < W - 1 + windowed.slack


def test_the_window_bounds_itself_and_max_kv_leaves_it(rng):
    cache = WindowedKVCache(W)
    cache.update_and_fetch(*kv(rng, 30))
    assert isinstance(cache, LayerCache) and not cache.trimmable and cache.window == W
    assert cache.live_len == cache.held == W - 1 and cache.nbytes == 2 * (W - 1) * H * D * 4
    assert enforce_max_kv([cache], 2) == 0 and cache.live_len == W - 1
    keys, _ = cache.update_and_fetch(*kv(rng, 1))
    assert keys.shape[2] == W  # a decode step attends to exactly the window
    assert masks.causal(1, W - 1 + 1, window=W) is None  # ... with no mask
    assert isinstance(cache.batch_layer(), BatchWindowedKVCache)
    assert cache.key_valid(1) is None
    with pytest.raises(ValueError, match="at least 1"):
        WindowedKVCache(0)


def test_a_vacuous_window_keeps_the_fast_masks():
    assert masks.causal(1, W, window=W) is None  # every key inside the window
    assert masks.causal(3, W, window=W) == "causal"
    assert isinstance(masks.causal(1, W + 1, window=W), mx.array)
    window = masks.causal(2, 4, window=2)  # on the CPU left unbuilt for attend's blocks
    if isinstance(window, masks.Window):
        window = window.array()
    np.testing.assert_array_equal(
        np.array(window), [[False, True, True, False], [False, False, True, True]]
    )


def _valid_rows(batch: BatchKVCache) -> list[np.ndarray]:
    keys = np.array(batch.keys[..., : batch.live_len, :])
    valid = batch.key_valid()
    valid = np.ones((len(keys), keys.shape[2]), bool) if valid is None else np.array(valid)[:, 0, 0]
    return [keys[b][:, valid[b], :] for b in range(len(keys))]


def test_batch_rows_keep_exactly_their_last_window(monkeypatch, rng):
    """Rows of different lengths join (one below the window), decode, one leaves; after every
    step each row holds exactly its sequence's last window - 1 keys, and the buffer stays
    bounded (compaction with a small step)."""
    monkeypatch.setattr(BatchKVCache, "step", 4)
    seqs = {r: WindowedKVCache(W) for r in range(3)}
    history = {r: [] for r in range(3)}

    def write(r, k):
        seqs[r].update_and_fetch(k, -k)
        history[r].append(np.array(k[0]))

    for r, n in enumerate((17, 2, 9)):
        write(r, kv(rng, n)[0])
    batch = BatchWindowedKVCache(W)
    members = [0, 1]
    batch.extend([seqs[0], seqs[1]])
    for step in range(20):
        if step == 3:
            batch.extend([seqs[2]])
            members.append(2)
        if step == 12:
            batch.keep_rows([1, 2])
            members.remove(0)
        new, _ = kv(rng, 1, len(members))
        batch.update_and_fetch(new, -new)
        for b, r in enumerate(members):
            history[r].append(np.array(new[b]))
        for b, r in enumerate(members):
            want = np.concatenate(history[r], axis=1)[:, -(W - 1) :, :]
            np.testing.assert_array_equal(_valid_rows(batch)[b], want)
            assert int(batch.offset[b]) == sum(h.shape[1] for h in history[r])
        assert batch.live_len <= W - 1 + 2 * BatchKVCache.step
    assert enforce_max_kv([batch], 2) == 0  # not trimmable: the window is its bound


def test_mistral_sliding_window_matches_transformers(tmp_path, rng):
    """The llama spec serves mistral: a config's sliding_window windows every layer."""
    from transformers import MistralConfig, MistralForCausalLM

    path = ckpt._make_hf(
        MistralConfig,
        MistralForCausalLM,
        tmp_path,
        dict(ckpt._COMMON, head_dim=16, sliding_window=7),
        {},
        seed=3,
        tokenizer=False,
        legacy_config=False,
    )
    hf = MistralForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
    ids = rng.integers(0, 300, size=(1, 31))
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ids)).logits.numpy()
    model = mlxc.load_model(path)
    assert {c.window for c in model.make_cache()} == {7}
    cache, parts = model.make_cache(), []
    for a, b in [(0, 3), (3, 15), (15, 22), (22, 29), (29, 30), (30, 31)]:
        parts.append(np.array(model(mx.array(ids[:, a:b]), cache=cache)))
    np.testing.assert_allclose(np.concatenate(parts, axis=1), want, atol=1e-4)
    np.testing.assert_allclose(np.array(model(mx.array(ids))), want, atol=1e-4)


@pytest.mark.parametrize(
    "factory, layer_types",
    [
        ("make_qwen2", None),  # use_sliding_window: layers from max_window_layers on
        ("make_qwen3", ["sliding_attention", "full_attention", "sliding_attention"]),
    ],
)
def test_qwen_sliding_layers_match_transformers(tmp_path, rng, factory, layer_types):
    """Qwen2/Qwen3 with use_sliding_window: the window is per layer (max_window_layers, or the
    config's layer_types), one attention class whose window may be None."""
    from transformers import AutoModelForCausalLM

    extra = {} if layer_types is None else {"layer_types": layer_types}
    path = getattr(ckpt, factory)(
        tmp_path,
        seed=4,
        tokenizer=False,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
        **extra,
    )
    hf = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
    windows = [6 if t == "sliding_attention" else None for t in hf.config.layer_types]
    assert None in windows and 6 in windows
    ids = rng.integers(0, 300, size=(1, 29))
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ids)).logits.numpy()
    model = mlxc.load_model(path)
    assert [c.window for c in model.make_cache()] == windows
    cache, parts = model.make_cache(), []
    for a, b in [(0, 4), (4, 17), (17, 27), (27, 28), (28, 29)]:
        parts.append(np.array(model(mx.array(ids[:, a:b]), cache=cache)))
    np.testing.assert_allclose(np.concatenate(parts, axis=1), want, atol=1e-4)
