"""The decode batch (runtime.model.batch): every row keeps exactly its own sequence's live keys, in
order, through joins, leaves, per-row trims with sinks and compaction. (`mlxc verify` checks
batched logits against decoding alone for every spec; test_scheduler that the server batches.)"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxc.runtime.model.batch import BatchKVCache, BatchQuantizedKVCache
from mlxc.runtime.model.cache import (
    KVCache,
    KVQuant,
    QuantizedKVCache,
    RewindError,
    dense,
    enforce_max_kv,
)

H, D = 2, 3


def chunks(rng, n: int) -> list[np.ndarray]:
    return [rng.standard_normal((1, H, min(5, n - i), D)) for i in range(0, n, 5)]


def filled(parts: list[np.ndarray], max_kv: int | None, keep: int) -> KVCache:
    """A one-row cache that took ``parts`` (keys; values are twice the keys), trimmed after
    each part as generation trims."""
    cache = KVCache()
    for part in parts:
        cache.update_and_fetch(mx.array(part), mx.array(2 * part))
        enforce_max_kv([cache], max_kv, keep)
    return cache


def live(cache: KVCache) -> np.ndarray:
    return np.array(cache.keys[0, :, : cache.live_len, :])


def batch_rows(batch: BatchKVCache) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each row's valid keys and values, in column order."""
    keys = np.array(batch.keys[..., : batch.live_len, :])
    values = np.array(batch.values[..., : batch.live_len, :])
    mask = batch.key_valid()  # None: every column of every row is valid
    valid = (
        np.ones((keys.shape[0], keys.shape[2]), bool)
        if mask is None
        else np.array(mask)[:, 0, 0, :]
    )
    return [(keys[b][:, valid[b], :], values[b][:, valid[b], :]) for b in range(len(keys))]


@pytest.mark.parametrize("max_kv, keep", [(None, 0), (12, 0), (12, 4), (30, 2)])
def test_rows_hold_exactly_their_sequences_live_keys(monkeypatch, rng, max_kv, keep):
    # A small step makes growth and compaction happen within a short schedule.
    monkeypatch.setattr(KVCache, "step", 8)
    monkeypatch.setattr(BatchKVCache, "step", 8)
    prompts = [chunks(rng, n) for n in (23, 4, 40)]
    alone = [filled(p, max_kv, keep) for p in prompts]
    batch = BatchKVCache()
    members = [0, 1]
    batch.extend([filled(prompts[r], max_kv, keep) for r in members])
    compacted = False
    for step in range(60):
        if step == 7:
            members.append(2)
            batch.extend([filled(prompts[2], max_kv, keep)])
        if step == 30:
            batch.keep_rows([1, 2])  # the first row leaves
            members.remove(0)
        new = [rng.standard_normal((1, H, 1, D)) for _ in members]
        width = batch.live_len
        batch.update_and_fetch(mx.array(np.concatenate(new)), mx.array(2 * np.concatenate(new)))
        enforce_max_kv([batch], max_kv, keep)
        compacted |= batch.live_len <= width
        for r, k in zip(members, new):
            alone[r].update_and_fetch(mx.array(k), mx.array(2 * k))
            enforce_max_kv([alone[r]], max_kv, keep)
        for b, (keys, values) in enumerate(batch_rows(batch)):
            r = members[b]
            np.testing.assert_array_equal(keys, live(alone[r]))
            np.testing.assert_array_equal(values, 2 * live(alone[r]))
            assert int(batch.offset[b]) == alone[r].offset  # monotonic, trims included
            assert batch.row_live_len[b] == alone[r].live_len
        if max_kv is not None:
            # Resident memory bounded: the width, and the buffer's capacity past it.
            assert batch.live_len <= max_kv + 2 * BatchKVCache.step
            assert batch.keys.shape[2] <= max_kv + 3 * BatchKVCache.step
    assert compacted == (max_kv is not None)


@pytest.mark.parametrize("max_kv, keep", [(None, 0), (12, 0), (12, 4)])
def test_a_row_placed_over_a_dead_one_holds_exactly_its_keys(monkeypatch, rng, max_kv, keep):
    """Row 0's sequence leaves at step 10 but its row stays (dead, still written to); at step
    14 another sequence is placed over it (``place``: no other row copied) and from then on
    that row holds exactly the new sequence's live keys, the other rows theirs."""
    monkeypatch.setattr(KVCache, "step", 8)
    monkeypatch.setattr(BatchKVCache, "step", 8)
    prompts = [chunks(rng, n) for n in (23, 4, 30, 9)]
    alone = [filled(p, max_kv, keep) for p in prompts]
    batch = BatchKVCache()
    batch.extend([filled(prompts[r], max_kv, keep) for r in (0, 1, 2)])
    members: list[int | None] = [0, 1, 2]
    for step in range(40):
        if step == 10:
            members[0] = None  # left: its row decodes on, unread
        if step == 14:
            joining = BatchKVCache()
            joining.extend([filled(prompts[3], max_kv, keep)])
            assert batch.fits(joining)
            others = np.array(batch.keys[1:])
            batch.place([0], joining)
            members[0] = 3
            np.testing.assert_array_equal(np.array(batch.keys[1:]), others)  # untouched
        new = [rng.standard_normal((1, H, 1, D)) for _ in members]
        batch.update_and_fetch(mx.array(np.concatenate(new)), mx.array(2 * np.concatenate(new)))
        enforce_max_kv([batch], max_kv, keep)
        for r, k in zip(members, new):
            if r is not None:
                alone[r].update_and_fetch(mx.array(k), mx.array(2 * k))
                enforce_max_kv([alone[r]], max_kv, keep)
        for b, (keys, values) in enumerate(batch_rows(batch)):
            r = members[b]
            if r is None:
                continue
            np.testing.assert_array_equal(keys, live(alone[r]))
            np.testing.assert_array_equal(values, 2 * live(alone[r]))
            assert int(batch.offset[b]) == alone[r].offset
            assert batch.row_live_len[b] == alone[r].live_len


def test_place_needs_a_batch_at_least_as_wide(rng):
    narrow, wide = BatchKVCache(), BatchKVCache()
    narrow.extend([filled(chunks(rng, 4), None, 0)])
    wide.extend([filled(chunks(rng, 9), None, 0)])
    assert wide.fits(narrow) and not narrow.fits(wide)


def test_a_batch_takes_only_filled_single_rows():
    with pytest.raises(ValueError, match="single sequence"):
        BatchKVCache().extend([KVCache()])


@pytest.mark.parametrize("quant", [None, KVQuant(8, 32)])
@pytest.mark.parametrize("max_kv, keep", [(None, 0), (14, 2), (30, 4)])
def test_rows_that_keep_different_drafts_hold_exactly_their_keys(
    monkeypatch, rng, max_kv, keep, quant
):
    """Speculation in the batch: every few steps each row takes ``k + 1`` columns and keeps a
    different number (``rewind_rows``), rows with tails take plain steps, join, leave, are
    placed over and trimmed; each row holds exactly what a cache that took only its kept
    tokens holds, and a forward of several queries masks each query's later columns."""
    monkeypatch.setattr(KVCache, "step", 8)
    monkeypatch.setattr(BatchKVCache, "step", 8)
    width = 32 if quant else D  # a quantised head vector is whole groups
    make = (lambda: QuantizedKVCache(quant)) if quant else KVCache

    def one(parts):
        cache = make()
        for part in parts:
            cache.update_and_fetch(mx.array(part), mx.array(2 * part))
            enforce_max_kv([cache], max_kv, keep)
        return cache

    def rows_of(batch):
        keys, values = (dense(b[..., : batch.live_len, :]) for b in (batch.keys, batch.values))
        mask = batch.key_valid()
        valid = np.ones(keys.shape[::2], bool) if mask is None else np.array(mask)[:, 0, 0, :]
        return [
            (np.array(keys[b])[:, valid[b]], np.array(values[b])[:, valid[b]])
            for b in range(keys.shape[0])
        ]

    def part(n):
        return rng.standard_normal((1, H, n, width)).astype(np.float32)

    prompts = [[part(5) for _ in range(n)] for n in (4, 1, 6, 2)]
    alone = [one(p) for p in prompts]
    batch = BatchQuantizedKVCache(quant) if quant else BatchKVCache()
    batch.extend([one(prompts[r]) for r in (0, 1, 2)])
    members, tails, masked = [0, 1, 2], False, False
    for step in range(36):
        if step == 9:
            batch.keep_rows([0, 2])  # a row with a tail may leave
            members.remove(1)
        if step == 15:
            joining = BatchQuantizedKVCache(quant) if quant else BatchKVCache()
            joining.extend([one(prompts[3])])
            assert batch.fits(joining)
            batch.place([0], joining)  # row 0 leaves; another takes its row, tail and all
            members[0] = 3
        k = 3 if step % 3 == 0 else 0  # a verification, or a plain step
        new = [part(k + 1) for _ in members]
        valid = batch.key_valid(k + 1)
        if valid is not None and k and valid.shape[2] == k + 1:
            masked = True  # each query of each row: the row's keys, then its new ones to here
            v, before = np.array(valid)[:, 0], np.array(batch._valid())
            for b in range(len(members)):
                own = np.flatnonzero(v[b, -1])[before[b].sum() :]
                assert len(own) == k + 1
                for i in range(k + 1):
                    assert (np.flatnonzero(v[b, i])[before[b].sum() :] == own[: i + 1]).all()
        batch.update_and_fetch(mx.array(np.concatenate(new)), mx.array(2 * np.concatenate(new)))
        kept = rng.integers(1, k + 2, size=len(members))  # the input token and kept drafts
        batch.rewind_rows(k + 1 - kept)
        tails |= bool(batch.tail.any())
        enforce_max_kv([batch], max_kv, keep)
        for r, n, x in zip(members, kept, new):
            alone[r].update_and_fetch(mx.array(x[:, :, :n]), mx.array(2 * x[:, :, :n]))
            enforce_max_kv([alone[r]], max_kv, keep)
        for b, (keys, values) in enumerate(rows_of(batch)):
            r = members[b]
            a = alone[r]
            np.testing.assert_array_equal(keys, np.array(dense(a.keys[..., : a.live_len, :]))[0])
            np.testing.assert_array_equal(values, 2 * keys)
            assert int(batch.offset[b]) == a.offset
            assert batch.row_live_len[b] == a.live_len
        if max_kv is not None:
            assert batch.live_len <= max_kv + 2 * BatchKVCache.step + 3
    assert tails and masked


def test_rows_rewind_only_what_they_wrote_since_the_last_change(rng):
    batch = BatchKVCache()
    batch.extend([filled(chunks(rng, n), None, 0) for n in (6, 4)])
    new = mx.array(rng.standard_normal((2, H, 3, D)))
    batch.update_and_fetch(new, new)
    with pytest.raises(RewindError):
        batch.rewind_rows(np.array([1, 4]))
    with pytest.raises(ValueError, match="2 rows"):
        batch.rewind_rows(np.array([1]))
    batch.rewind_rows(np.array([0, 2]))
    assert batch.tail.tolist() == [0, 2] and batch.offsets.tolist() == [9, 5]
    with pytest.raises(RewindError):
        batch.rewind_rows(np.array([0, 2]))  # row 1 has one of the three columns left
    batch.rewind_rows(np.array([1, 1]))


@pytest.mark.parametrize("keep", [0, 3])
def test_a_bounded_verification_sees_what_one_token_steps_would(monkeypatch, rng, keep):
    """Under ``decode_bound`` (a speculative verification past ``--max-kv-size``) each query
    of each row sees the keys its one-token step would have seen, trims between steps
    included: the keys a lone ``KVCache`` under the same bound shows that query. Rows of
    different lengths, trimmed and not, one with a tail."""
    monkeypatch.setattr(KVCache, "step", 8)
    monkeypatch.setattr(BatchKVCache, "step", 8)
    max_kv, n_new = 12, 4
    prompts = [chunks(rng, n) for n in (20, 9, 12)]
    alone = [filled(p, max_kv, keep) for p in prompts]
    batch = BatchKVCache()
    batch.extend([filled(p, max_kv, keep) for p in prompts])
    # A verification where row 1 kept one token fewer than the others: a tail.
    new = rng.standard_normal((3, H, 2, D))
    batch.update_and_fetch(mx.array(new), mx.array(2 * new))
    batch.rewind_rows(np.array([0, 1, 0]))
    enforce_max_kv([batch], max_kv, keep)
    for b, cache in enumerate(alone):
        kept = new[b : b + 1, :, : 2 - (b == 1)]
        cache.update_and_fetch(mx.array(kept), mx.array(2 * kept))
        enforce_max_kv([cache], max_kv, keep)
    assert batch.tail.tolist() == [0, 1, 0]
    new = rng.standard_normal((3, H, n_new, D))
    batch.decode_bound = (max_kv, keep)
    valid = np.array(batch.key_valid(n_new))[:, 0]  # [B, n_new, columns]
    keys, _ = batch.update_and_fetch(mx.array(new), mx.array(2 * new))
    for b, cache in enumerate(alone):
        cache.decode_bound = (max_kv, keep)
        mask = cache.key_valid(n_new)
        mine, _ = cache.update_and_fetch(mx.array(new[b : b + 1]), mx.array(2 * new[b : b + 1]))
        mask = np.ones((n_new, mine.shape[2]), bool) if mask is None else np.array(mask)[0, 0]
        causal = (
            np.arange(mine.shape[2])[None, :] <= np.arange(n_new)[:, None] + mine.shape[2] - n_new
        )
        for j in range(n_new):
            want = np.array(mine[0])[:, mask[j] & causal[j]]
            np.testing.assert_array_equal(np.array(keys[b])[:, valid[b, j]], want)
    assert valid[0, -1].sum() < valid[0, 0].sum() + n_new - 1  # the bound dropped keys
