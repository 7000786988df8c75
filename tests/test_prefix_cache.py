"""The prefix cache's trie (chunk-aligned lookup, partial hits, image keys, LRU eviction under
the byte budget) and each cache kind's snapshot and resume (prefix_block / resume): a resumed
cache continues exactly as the one it was taken from, and a snapshot is unchanged by what the
live cache does afterwards (slice writes, trims)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxc.runtime.model.cache import KVCache, WindowedKVCache
from mlxc.runtime.model.ssm import Mamba2Mixer, RecurrentCache
from mlxc.runtime.serving.prefix_cache import (
    TEXT,
    PrefixCache,
    cacheable,
    chunk_key,
    image_digest,
)

RNG = np.random.default_rng(0)


def kv(n: int, heads: int = 2, dim: int = 8) -> tuple[mx.array, mx.array]:
    shape = (1, heads, n, dim)
    return mx.array(RNG.standard_normal(shape, np.float32)), mx.array(
        RNG.standard_normal(shape, np.float32)
    )


def blocks_of(cache, chunks):
    """Feed ``chunks`` (k, v) to ``cache``; its blocks at each boundary and what each update
    returned."""
    blocks, returned, start = [], [], 0
    for k, v in chunks:
        returned.append(cache.update_and_fetch(k, v))
        block = cache.prefix_block(start)
        mx.eval(block)
        blocks.append(block)
        start = cache.offset
    return blocks, returned


# --- cache kinds ---------------------------------------------------------------------------------


def test_full_kv_resumes_where_its_blocks_end_and_blocks_are_copies():
    chunks = [kv(4) for _ in range(4)]
    live = KVCache()
    blocks, returned = blocks_of(live, chunks)
    frozen = [[np.array(a) for a in b] for b in blocks]
    live.update_and_fetch(*kv(300))  # grows the buffer
    live.trim_front(200, keep=2)  # slides keys down over the old positions
    assert all(
        np.array_equal(np.array(a), f) for b, fb in zip(blocks, frozen) for a, f in zip(b, fb)
    )
    assert [b[0].shape[2] for b in blocks] == [4, 4, 4, 4]
    resumed = KVCache()
    resumed.resume(blocks[:3], 12)
    assert (resumed.offset, resumed.live_len) == (12, 12)
    keys, values = resumed.update_and_fetch(*chunks[3])
    assert np.array_equal(np.array(keys), np.array(returned[3][0]))
    assert np.array_equal(np.array(values), np.array(returned[3][1]))


def test_a_block_holds_its_own_bytes_not_the_live_buffer():
    """What the budget counts (``nbytes``) is what is held: once the live cache is gone, only
    the block's bytes stay allocated (a slice would keep the whole 256-token buffer)."""
    import gc

    cache = KVCache()
    cache.update_and_fetch(*kv(8, heads=1, dim=4096))  # a buffer of 256 tokens, 4 MiB each
    mx.eval(cache.arrays())
    before = mx.get_active_memory()
    block = cache.prefix_block(4)
    mx.eval(block)
    held = sum(a.nbytes for a in block)
    assert held == 2 * 4 * 4096 * 4
    del cache
    gc.collect()
    assert mx.get_active_memory() - before <= held - 2 * 256 * 4096 * 4


def test_a_trimmed_full_kv_cache_holds_no_prefix():
    cache = KVCache()
    cache.update_and_fetch(*kv(10))
    cache.trim_front(3, keep=2)
    assert cache.prefix_block(0) is None


def test_latent_cache_without_values_resumes():
    cache = KVCache()
    k, _ = kv(5)
    cache.update_and_fetch(k)
    block = cache.prefix_block(0)
    assert len(block) == 1
    resumed = KVCache()
    resumed.resume([block], 5)
    assert resumed.values is None and np.array_equal(np.array(resumed.live()[0]), np.array(k))


@pytest.mark.parametrize("window", [3, 6, 40])
def test_windowed_kv_snapshot_holds_what_the_window_needs(window):
    """Chunks of 4 against windows shorter than a chunk, longer than one, longer than all."""
    chunks = [kv(4) for _ in range(6)]
    live = WindowedKVCache(window)
    blocks, returned = blocks_of(live, chunks)
    assert all(b[0].shape[2] == min(4, window - 1) for b in blocks)
    for at in (1, 3, 5):  # resume after `at` chunks, continue with the rest
        resumed = WindowedKVCache(window)
        resumed.resume(blocks[:at], 4 * at)
        assert resumed.offset == 4 * at and resumed.live_len == min(4 * at, window - 1)
        for (k, v), (want_k, want_v) in zip(chunks[at:], returned[at:]):
            got_k, got_v = resumed.update_and_fetch(k, v)
            assert np.array_equal(np.array(got_k), np.array(want_k))
            assert np.array_equal(np.array(got_v), np.array(want_v))


def test_recurrent_state_resumes_exactly_at_its_boundary():
    """A Mamba2 mixer over three chunks, and over the last one from the state snapshotted after
    the second: the same output and final state."""
    mixer = Mamba2Mixer(
        hidden_size=16,
        num_heads=4,
        head_dim=4,
        state_size=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=4,
    )
    mixer.update({k: v * 3 for k, v in mixer.parameters().items() if isinstance(v, mx.array)})
    x = mx.array(RNG.standard_normal((1, 14, 16), np.float32))
    live, blocks = RecurrentCache(), []
    outs = []
    for start, end in ((0, 5), (5, 9), (9, 14)):
        outs.append(mixer(x[:, start:end], live))
        blocks.append(live.prefix_block(start))
        mx.eval(outs[-1], blocks[-1])
    resumed = RecurrentCache()
    resumed.resume(blocks[:2], 9)
    out = mixer(x[:, 9:14], resumed)
    assert resumed.offset == live.offset == 14
    assert np.array_equal(np.array(out), np.array(outs[2]))
    assert np.array_equal(np.array(resumed.ssm), np.array(live.ssm))
    assert RecurrentCache().prefix_block(0) is None  # nothing run yet


def test_only_caches_with_the_capability_are_cacheable():
    class Owned:  # a model-owned state outside the protocol
        pass

    assert cacheable([KVCache(), WindowedKVCache(4), RecurrentCache()])
    assert not cacheable([KVCache(), Owned()])
    assert not cacheable([])


# --- the trie ----------------------------------------------------------------------------------


def prefill_chunks(n: int, size: int) -> list[tuple[int, int]]:
    """Chunks of ``size`` then the rest: ``generate.prefill_chunks`` on a GPU (on the CPU it
    also splits off the last token), here fixed so that the counts below hold anywhere."""
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def fill(tree: PrefixCache, prompt, chunks, marker=None, nbytes=64, resumable=lambda s: True):
    """Insert a node per chunk but the last (as the scheduler does), each holding one block of
    ``nbytes`` bytes; the nodes."""
    node, nodes = tree.root, []
    for start, end in chunks[:-1]:
        block = [[mx.zeros((nbytes // 4,), mx.float32)]]
        key = chunk_key(prompt, start, end, marker)
        node = tree.insert(node, key, end, block, resumable=resumable(start))
        nodes.append(node)
    return nodes


def test_lookup_is_chunk_aligned_and_never_enters_the_last_chunk():
    tree = PrefixCache(1 << 20)
    prompt = list(range(1, 40))
    chunks = prefill_chunks(len(prompt), 8)
    fill(tree, prompt, chunks)
    assert tree.lookup(prompt, chunks).tokens == chunks[-1][0] == 32
    # Diverging inside the third chunk: the first two are reused (a partial hit).
    other = prompt[:20] + [99] * 20
    assert tree.lookup(other, prefill_chunks(len(other), 8)).tokens == 16
    # A longer prompt with the same start walks the same chunks, then past them: a miss there.
    longer = prompt + list(range(100, 150))
    assert tree.lookup(longer, prefill_chunks(len(longer), 8)).tokens == 32
    # Chunks of another size are other blocks: no hit (its forwards would differ).
    assert tree.lookup(prompt, prefill_chunks(len(prompt), 16)) is None
    assert tree.lookup([7] + prompt, prefill_chunks(40, 8)) is None
    assert (tree.hits, tree.hit_tokens) == (3, 80)


def test_a_boundary_inside_the_images_is_passed_through_never_resumed_at():
    tree = PrefixCache(1 << 20)
    prompt = list(range(1, 40))
    chunks = prefill_chunks(len(prompt), 8)
    fill(tree, prompt, chunks, resumable=lambda start: start != 16)  # the node ending at 24
    assert tree.lookup(prompt, chunks).tokens == 32
    short = prompt[:26] + [99] * 13  # its deepest shared node is the one ending at 24
    assert tree.lookup(short, prefill_chunks(len(short), 8)).tokens == 16


def test_image_nodes_need_the_same_images():
    tree = PrefixCache(1 << 20)
    prompt = list(range(1, 40))
    chunks = prefill_chunks(len(prompt), 8)
    a = image_digest({"pixel_values": np.ones((2, 3), np.float32), "grid": np.array([1, 2])})
    b = image_digest({"pixel_values": np.zeros((2, 3), np.float32), "grid": np.array([1, 2])})
    assert a != b
    node = tree.root
    for i, (start, end) in enumerate(chunks[:-1]):  # tokens before the image, then image nodes
        key = chunk_key(prompt, start, end, None if i < 2 else a)
        node = tree.insert(node, key, end, [[mx.zeros(4)]], resumable=True)
    assert tree.lookup(prompt, chunks, (None, a)).tokens == 32
    assert tree.lookup(prompt, chunks, (None, b)).tokens == 16  # only the text before the image
    assert tree.lookup(prompt, chunks).tokens == 16


def test_requests_with_images_do_not_resume_from_text_only_requests_of_a_vl_model():
    """A text-only prompt may hold image placeholder ids, embedded as text: its chunks (marked
    TEXT) serve text requests only; an image request's chunks before its image serve both."""
    tree = PrefixCache(1 << 20)
    prompt = list(range(1, 40))
    chunks = prefill_chunks(len(prompt), 8)
    digest = image_digest({"pixel_values": np.ones(3, np.float32)})
    fill(tree, prompt, chunks, marker=TEXT)
    assert tree.lookup(prompt, chunks, (None, TEXT)).tokens == 32
    assert tree.lookup(prompt, chunks, (None, digest)) is None
    other = prompt[:20] + [99] * 20
    fill(tree, other, chunks)  # an image request's chunks before its image (marker None)
    assert tree.lookup(other, chunks, (None, TEXT)).tokens == 32


def test_lru_eviction_keeps_the_budget_and_evicts_leaves_first():
    prompt_a, prompt_b = list(range(1, 41)), list(range(1, 17)) + list(range(200, 224))
    chunks = prefill_chunks(40, 8)
    key_bytes = 8 * 4  # a chunk's tokens as int32
    per_node = 64 + key_bytes
    tree = PrefixCache(7 * per_node)
    fill(tree, prompt_a, chunks)  # 4 nodes: 8, 16, 24, 32
    fill(tree, prompt_b, chunks)  # shares 8 and 16, adds 24', 32'
    assert tree.nodes == 6 and tree.nbytes == 6 * per_node
    tree.lookup(prompt_a, chunks)  # A is now the most recently used
    prompt_c = list(range(1, 9)) + list(range(300, 332))
    fill(tree, prompt_c, chunks)  # adds 16'', 24'', 32'': 9 nodes, B's two leaves go
    assert tree.nodes == 7 and tree.nbytes == 7 * per_node
    assert tree.lookup(prompt_a, chunks).tokens == 32
    assert tree.lookup(prompt_c, chunks).tokens == 32
    assert tree.lookup(prompt_b, chunks).tokens == 16  # its shared inner nodes stayed


def test_a_node_past_the_budget_is_not_kept_and_its_sequence_stops():
    tree = PrefixCache(50)
    prompt = list(range(1, 40))
    key = chunk_key(prompt, 0, 8, None)
    assert tree.insert(tree.root, key, 8, [[mx.zeros(64)]], resumable=True) is None
    assert tree.nodes == 0 and tree.nbytes == 0
    with pytest.raises(ValueError):
        PrefixCache(-1)
