import types

import mlx.core as mx
import pytest

from mlxc.runtime.model import masks
from mlxc.runtime.model.cache import (
    KVCache,
    QuantizedKVCache,
    QuantizedWindowedKVCache,
    WindowedKVCache,
    buffer_tokens,
    enforce_max_kv,
)


def kv(n, start=0):
    """[1, 1, n, 2] keys whose first feature is the absolute position, so order is checkable."""
    pos = mx.arange(start, start + n, dtype=mx.float32)
    k = mx.stack([pos, -pos], axis=-1)[None, None]
    return k, k * 10


def positions(keys):
    return keys[0, 0, :, 0].tolist()


def test_prefill_trim_append_sizes_mask_from_live_len():
    cache = KVCache()
    cache.update_and_fetch(*kv(8))
    assert (cache.offset, cache.live_len) == (8, 8)
    assert cache.trim_front(3) == 3
    assert (cache.offset, cache.live_start, cache.live_len) == (8, 3, 5)
    keys, values = cache.update_and_fetch(*kv(4, start=8))
    assert keys.shape[2] == 9 and values.shape[2] == 9
    assert cache.offset == 12
    assert cache.live_len == 9
    assert positions(keys) == [3, 4, 5, 6, 7, 8, 9, 10, 11]
    mask = masks.causal(4, cache.live_len)
    assert mask == "causal"
    with masks.array_masks():
        mask = masks.causal(4, cache.live_len)
        assert mask.shape == (4, 9)  # not 12: a mask sized from offset would not broadcast
        masks.check(mask, 4, keys.shape[2])
        with pytest.raises(masks.MaskWidthError):
            masks.check(masks.causal(4, cache.offset), 4, keys.shape[2])


def test_trim_keeps_sink_tokens():
    cache = KVCache()
    cache.update_and_fetch(*kv(10))
    cache.trim_front(4, keep=2)
    keys, _ = cache.update_and_fetch(*kv(1, start=10))
    assert positions(keys) == [0, 1, 6, 7, 8, 9, 10]
    assert (cache.offset, cache.live_len) == (11, 7)


def test_trim_clamps_and_rejects_negative():
    cache = KVCache()
    cache.update_and_fetch(*kv(5))
    assert cache.trim_front(100, keep=2) == 3
    assert cache.live_len == 2 and cache.offset == 5
    assert cache.trim_front(1, keep=2) == 0
    with pytest.raises(ValueError):
        cache.trim_front(-1)


def test_growth_past_step_keeps_contents():
    cache = KVCache()
    cache.step = 4
    for start in range(0, 10, 3):
        n = min(3, 10 - start)
        keys, _ = cache.update_and_fetch(*kv(n, start))
    assert positions(keys) == list(range(10))


def test_enforce_max_kv_trims_each_cache_to_the_limit():
    caches = [KVCache(), KVCache()]
    for c in caches:
        c.update_and_fetch(*kv(20))
    assert enforce_max_kv(caches, 16, keep=4) == 4
    assert [c.live_len for c in caches] == [16, 16]
    assert [c.offset for c in caches] == [20, 20]
    assert enforce_max_kv(caches, None) == 0
    with pytest.raises(ValueError):
        enforce_max_kv(caches, 4, keep=4)


def test_causal_array_mask_is_bottom_right_aligned():
    with masks.array_masks():
        m = masks.causal(2, 4)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert masks.causal(1, 4) is None
    with pytest.raises(ValueError):
        masks.causal(5, 4)


def _protocol_members() -> set[str]:
    from mlxc.runtime.model.cache import LayerCache

    # Its methods and properties, and its annotated attributes (trimmable).
    names = set(vars(LayerCache)) | set(LayerCache.__annotations__)
    return {n for n in names if not n.startswith("_")}


def test_readme_cache_contract_lists_the_protocol_members():
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = readme.split("\n## The KV cache contract\n", 1)[1].split("```\nLayerCache\n", 1)[1]
    block = block.split("```", 1)[0]
    listed = set(re.findall(r"^  (\w+)", block, re.MULTILINE))
    assert listed == _protocol_members()


def test_kv_caches_satisfy_the_protocol():
    from mlxc.runtime.model.batch import BatchKVCache
    from mlxc.runtime.model.cache import LayerCache

    cache = KVCache()
    cache.update_and_fetch(*kv(3))
    assert isinstance(cache, LayerCache) and cache.trimmable and cache.holds_keys
    assert BatchKVCache.holds_keys
    assert len(cache.arrays()) == 2 and isinstance(cache.batch_layer(), BatchKVCache)
    assert BatchKVCache().batch_layer() is None  # a batch's rows do not join another batch


def test_is_layer_cache_is_the_protocol_check_per_type():
    """``is_layer_cache`` (once per type) answers as ``isinstance(c, LayerCache)`` for every
    cache kind, and for model-owned state outside the protocol, asked twice."""
    from mlxc.runtime.model import batch, ssm
    from mlxc.runtime.model.cache import KVQuant, LayerCache, is_layer_cache

    quant = KVQuant(4, 32)
    objects = [
        KVCache(),
        WindowedKVCache(8),
        QuantizedKVCache(quant),
        QuantizedWindowedKVCache(8, quant),
        batch.BatchKVCache(),
        batch.BatchWindowedKVCache(8),
        batch.BatchQuantizedKVCache(quant),
        batch.BatchQuantizedWindowedKVCache(8, quant),
        ssm.RecurrentCache(),
        ssm.BatchRecurrentCache(),
        types.SimpleNamespace(state=None),  # model-owned state: not a LayerCache
    ]
    for _ in range(2):
        assert [is_layer_cache(c) for c in objects] == [isinstance(c, LayerCache) for c in objects]
    assert not is_layer_cache(objects[-1]) and all(map(is_layer_cache, objects[:-1]))


def test_buffers_are_never_a_multiple_of_256_tokens():
    """A buffer holds whole steps plus one token (``buffer_tokens``), so no slice of it is what
    MLX's CUDA attention hands to cuDNN, which builds a graph per buffer size: at every length
    a full and a windowed cache grow through."""
    for step in (KVCache.step, WindowedKVCache.step):
        for n in range(1, 3000):
            assert buffer_tokens(n, step) % 256 and buffer_tokens(n, step) > n
    cache = KVCache()
    for n in (1, 255, 256, 300):
        cache.update_and_fetch(*kv(n))
        assert cache.keys.shape[2] % 256 and cache.keys.shape[2] >= cache.offset


def test_buffers_handed_where_the_cuda_kernel_reads_them(monkeypatch):
    """Where mlxc's CUDA kernel reads the keys (``reads_buffers``, true here as on CUDA), a
    float ``KVCache`` fetch of a verification's few tokens is its whole buffers and the live
    count (``BufferKV``), after a trim too; a one-token step (``BUFFER_DECODE`` off), a prefill
    chunk longer than the kernel takes, and the kinds built on it (a window slices what it
    fetches; quantised kinds) hand slices. ``attend`` reads a ``BufferKV`` as the slices it
    stands for: off CUDA, exactly them."""
    from mlxc.runtime.model import cache as kv_cache
    from mlxc.runtime.model import cuda_attention
    from mlxc.runtime.model.cache import BufferKV, KVQuant
    from mlxc.runtime.model.layers import attend

    monkeypatch.setattr(kv_cache, "reads_buffers", lambda keys, values: True)
    monkeypatch.setattr(kv_cache, "staging", lambda keys, values: False)
    cache = KVCache()
    keys, _ = cache.update_and_fetch(*kv(40))  # a prefill chunk: past MAX_QUERIES
    assert isinstance(keys, mx.array) and positions(keys) == list(range(40))
    cache.trim_front(5, keep=2)
    keys, values = cache.update_and_fetch(*kv(4, start=40))
    assert isinstance(keys, BufferKV) and keys.buffer is cache.keys and keys.n == cache.live_len
    assert keys.shape == (1, 1, 39, 2) and values.shape == (1, 1, 39, 2)
    assert keys.buffer.shape[2] == buffer_tokens(40, KVCache.step) > 39  # the buffer itself
    assert positions(keys.live()) == [0, 1, *range(7, 44)]
    q = mx.array([[[[0.5, -0.25]] * 4]])  # [1, 1, 4, 2]
    got = attend(q, keys, values, scale=1.0, mask="causal")
    want = attend(q, keys.live(), values.live(), scale=1.0, mask="causal")
    assert mx.array_equal(got, want)
    step, _ = cache.update_and_fetch(*kv(1, start=44))
    assert isinstance(step, mx.array) and not cuda_attention.BUFFER_DECODE
    monkeypatch.setattr(cuda_attention, "BUFFER_DECODE", True)
    step, _ = cache.update_and_fetch(*kv(1, start=45))
    assert isinstance(step, BufferKV) and step.n == 41
    for other in (WindowedKVCache(8), QuantizedKVCache(KVQuant(4, 32))):
        other.update_and_fetch(*(mx.zeros((1, 1, 20, 32)) for _ in "kv"))
        fetched, _ = other.update_and_fetch(*(mx.zeros((1, 1, 3, 32)) for _ in "kv"))
        assert not isinstance(fetched, BufferKV)
