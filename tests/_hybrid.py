"""What the hybrid (state + attention) tests share: the checks of tests/test_nemotron_h.py,
tests/test_jamba.py and tests/test_granitemoehybrid.py against transformers, and the mask that
replays the trims.

Under a bounded cache the attention layers are trimmed (with sinks) and the recurrent state is
not. The reference for that is transformers' forward with each attention layer's mask hiding
exactly the keys the trims dropped, replayed from the trim rule itself: a kept key keeps the
position it was written at (RoPE, where there is one, rotated it then), so that is the same
computation.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import torch

from mlxc.runtime.model.cache import enforce_max_kv
from mlxc.runtime.model.ssm import RecurrentCache

ATOL = 1e-4
CHUNK_SIZES = [1, 2, 3, 7, 64]  # 2 < conv_kernel - 1: a chunk boundary splits the kernel


def reference(hf, ids: np.ndarray, attention_mask=None) -> np.ndarray:
    with torch.no_grad():
        return hf(input_ids=torch.from_numpy(ids), attention_mask=attention_mask).logits.numpy()


def ours(model, ids: np.ndarray, cache) -> np.ndarray:
    return np.array(model(mx.array(ids), cache=cache))


def close(got, want) -> None:
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def check_chunked(model, hf, ids: np.ndarray, size: int) -> None:
    cache = model.make_cache()
    parts = [ours(model, ids[:, i : i + size], cache) for i in range(0, ids.shape[1], size)]
    close(np.concatenate(parts, axis=1), reference(hf, ids))
    assert all(c.offset == ids.shape[1] for c in cache)


def check_decode(model, hf, ids: np.ndarray, prefill: int) -> None:
    """Prefill, then one token at a time (the recurrence's one-step path): the full pass."""
    cache = model.make_cache()
    parts = [ours(model, ids[:, :prefill], cache)]
    parts += [ours(model, ids[:, t : t + 1], cache) for t in range(prefill, ids.shape[1])]
    close(np.concatenate(parts, axis=1), reference(hf, ids))


def trimmed_mask(pieces: list[tuple[int, int]], max_kv: int, keep: int) -> torch.Tensor:
    """The additive mask [1, 1, L, L] of what each query still sees after the trims: the trim
    rule replayed on key positions (after each piece, the oldest past max_kv go, after the
    first ``keep`` sinks)."""
    total = pieces[-1][1]
    mask = torch.full((1, 1, total, total), -math.inf)
    live: list[int] = []
    for a, b in pieces:
        for p in range(a, b):
            mask[0, 0, p, live + list(range(a, p + 1))] = 0.0
        live += list(range(a, b))
        if len(live) > max_kv:
            live = live[:keep] + live[keep + len(live) - max_kv :]
    return mask


def check_decode_after_trims(model, hf, ids: np.ndarray, max_kv: int = 12, keep: int = 2):
    """Prefill in chunks of 5, then decode, enforce_max_kv after each: the attention layers are
    trimmed, the state never is; every logit equals transformers' with the trimmed keys masked
    out of its attention layers (its model needs the eager attention, for a float mask)."""
    prefill = 20
    pieces = [(a, min(a + 5, prefill)) for a in range(0, prefill, 5)]
    pieces += [(t, t + 1) for t in range(prefill, ids.shape[1])]
    cache, parts, dropped = model.make_cache(), [], 0
    for a, b in pieces:
        parts.append(ours(model, ids[:, a:b], cache))
        dropped += enforce_max_kv(cache, max_kv, keep=keep)
    assert dropped > 0
    for c in cache:
        assert c.offset == ids.shape[1]
        if isinstance(c, RecurrentCache):
            assert c.live_len == 0 and c.ssm is not None  # state, not keys: never trimmed
        else:
            assert c.live_len == max_kv
    mask = {"full_attention": trimmed_mask(pieces, max_kv, keep), "linear_attention": None}
    want = reference(hf, ids, attention_mask=mask)
    close(np.concatenate(parts, axis=1), want)
    # The guard: the trims change the output (the masked reference is not the plain one).
    assert np.abs(want - reference(hf, ids))[:, prefill:].max() > 1e-2


def check_state_size_is_constant(model) -> None:
    cache = model.make_cache()
    ours(model, np.array([[5, 6, 7, 8]]), cache)
    sizes = [c.nbytes for c in cache if isinstance(c, RecurrentCache)]
    assert sizes and all(sizes)
    for t in range(12):
        ours(model, np.array([[t + 3]]), cache)
    assert [c.nbytes for c in cache if isinstance(c, RecurrentCache)] == sizes
