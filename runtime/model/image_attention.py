"""Bidirectional attention among one image's tokens (Gemma 3), on top of the causal masks.

transformers' Gemma 3 marks image tokens with ``token_type_ids`` during prefill and lets every
token of one image attend to every other token of the same image, later ones included
(``create_masks_for_vision_model``): full-attention layers get ``causal OR same_image``, sliding
layers ``window AND (causal OR same_image)``. Generated tokens are never image tokens there
(``token_type_ids`` is dropped after the first iteration), so decode steps are plain causal.

Here an image is a run of consecutive image-token positions (transformers' ``block_sequence_ids``:
a new block starts at each image token not preceded by one; Gemma 3 wraps every image in
``<start_of_image>`` / ``<end_of_image>``, so two images never touch). Masks follow
``runtime.model.masks``: boolean, True = attend, ``[..., n_queries, n_keys]`` over the live keys with
the chunk's queries last.

Within one forward only the chunk's own keys can lie after a query, so the overlay only covers
the chunk's ``[L, L]`` corner: an image cut by a chunk boundary is not bidirectional across it.
:func:`image_spans` gives the spans a prefill must not cut (``runtime.serving.generate.prefill_chunks``).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from mlxc.runtime.model import masks


def image_groups(is_image: mx.array) -> mx.array:
    """``[B, L]`` int: for each image position the index of its run within the chunk, -1 for
    text (transformers' ``get_block_sequence_ids_for_mask``, per chunk)."""
    is_image = is_image.astype(mx.bool_)
    before = mx.concatenate([mx.zeros_like(is_image[:, :1]), is_image[:, :-1]], axis=1)
    starts = is_image & ~before
    return mx.where(is_image, mx.cumsum(starts.astype(mx.int32), axis=1) - 1, -1)


def overlay(is_image: mx.array, n_keys: int, window: int | None = None) -> mx.array:
    """``[B, 1, L, n_keys]`` bool: query ``i`` may attend key ``j`` as two tokens of one image.

    ``is_image`` ``[B, L]`` marks the chunk's image positions (e.g. ``ImageRows.mask[..., 0]``:
    the positions that took image features). The chunk's keys are the last ``L`` of ``n_keys``;
    earlier keys get no extra attention (causality already lets the chunk see them). With a
    sliding ``window`` an earlier key ``window`` or more positions back stays masked, as
    transformers ANDs its one-sided window (``kv_idx > q_idx - window``) over the OR; later
    keys of the image pass it at any distance.
    """
    groups = image_groups(is_image)
    B, L = groups.shape
    if L > n_keys:
        raise ValueError(f"{L} queries but only {n_keys} live keys: mask sized wrong")
    same = (groups[:, :, None] == groups[:, None, :]) & (groups[:, :, None] >= 0)
    if window is not None:
        pos = mx.arange(L)
        same = same & (pos[None, :] > pos[:, None] - window)
    past = mx.zeros((B, L, n_keys - L), dtype=mx.bool_)
    return mx.concatenate([past, same], axis=-1)[:, None]


def with_images(
    mask: mx.array | masks.Window | str | None,
    is_image: mx.array | None,
    n_keys: int,
    window: int | None = None,
) -> mx.array | str | None:
    """``mask`` (from ``masks.causal(L, n_keys, key_valid, window)``, same ``window``) OR the
    image overlay; ``mask`` itself when the chunk holds no two tokens of one image.

    A string ``"causal"`` mask is made an array first (it meant: queries last, no window, every
    key valid). A ``key_valid`` already in ``mask`` needs no repeat: the overlay only adds the
    chunk's own keys, which are valid for the rows that hold them.
    """
    if is_image is None or is_image.shape[-1] < 2:
        return mask  # one query: the only same-image key after it does not exist
    extra = overlay(is_image, n_keys, window)
    if mask is None or isinstance(mask, str):
        mask = masks.causal_array(is_image.shape[-1], n_keys)
    elif isinstance(mask, masks.Window):  # the overlay makes it a mask of another kind
        mask = mask.array()
    return mask | extra


def image_spans(token_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """``(start, end)`` of every run of ``image_token_id`` in a prompt: what a prefill chunk
    boundary must not cut for the image to stay bidirectional."""
    ids = np.asarray(token_ids)
    is_image = np.concatenate([[False], ids == image_token_id, [False]])
    edges = np.flatnonzero(is_image[1:] != is_image[:-1])
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]
