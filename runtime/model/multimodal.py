"""Per-sequence state that spans prefill chunks: image features and where they go.

Vision inputs arrive with the first chunk of a prompt; the tower runs once and its features are
kept on the sequence's cache (``SequenceCache.images``). Each chunk then takes the next rows, in
prompt order, for its image placeholder tokens, so a chunk boundary may fall anywhere, inside an
image included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlxc.runtime.model.cache import LayerCache


class SequenceCache(list):
    """One sequence's layer caches (one per layer that caches) plus its prompt state.

    It is a list, so the scheduler and ``enforce_max_kv`` treat it like any cache list.
    ``offset`` is the sequence's monotonic position (every layer's cache agrees on it).
    """

    def __init__(self, caches: list[LayerCache]) -> None:
        super().__init__(caches)
        self.images: ImageFeatures | None = None
        self.rope_state = None  # model-specific position state (MRoPE), set by the model

    @property
    def offset(self) -> int:
        return self[0].offset

    def windows(self) -> dict[int | None, LayerCache]:
        """The first layer cache of each attention window (None: full attention). The layers
        of one window hold the same keys (``live-window``): one mask per window is sized from
        that cache, and ``attend`` refuses it in any layer holding another number of keys.
        Caches that hold no keys (a recurrent layer's state) have no mask and are skipped."""
        first: dict[int | None, LayerCache] = {}
        for cache in self:
            if cache.holds_keys:
                first.setdefault(cache.window, cache)
        return first


@dataclass
class ImageFeatures:
    """Features of every image token of a prompt, in order, and how many chunks used so far."""

    embeds: mx.array  # [N, D]
    extra: list[mx.array] = field(default_factory=list)  # e.g. DeepStack features, each [N, D]
    consumed: int = 0

    def take(self, input_ids: mx.array, image_token_id: int) -> ImageRows | None:
        """Claim the rows for this chunk's image tokens (None when the chunk has none).

        Once every row is used, a placeholder token is plain text (a model may generate one;
        transformers embeds it as text too).
        """
        if self.consumed == self.embeds.shape[0]:
            return None  # checked first: reading input_ids would stall the decode pipeline
        is_image = np.asarray(input_ids) == image_token_id
        n = int(is_image.sum())
        if n == 0:
            return None
        if self.consumed + n > self.embeds.shape[0]:
            raise ValueError(
                f"the prompt has more image tokens ({self.consumed + n}) than its images "
                f"provide ({self.embeds.shape[0]}): image placeholders and images disagree"
            )
        # Row-major over the batch, as transformers' masked_scatter fills them.
        index = np.cumsum(is_image.reshape(-1)).reshape(is_image.shape) - 1 + self.consumed
        self.consumed += n
        return ImageRows(mx.array(is_image)[..., None], mx.array(np.maximum(index, 0)))


@dataclass
class ImageRows:
    mask: mx.array  # [B, L, 1] bool: image-token positions of this chunk
    index: mx.array  # [B, L] row of the features each position takes

    def replace(self, h: mx.array, features: mx.array) -> mx.array:
        """Image-token rows of ``h`` replaced by their feature rows."""
        return mx.where(self.mask, features[self.index].astype(h.dtype), h)

    def add(self, h: mx.array, features: mx.array) -> mx.array:
        """Feature rows added at the image-token rows of ``h`` (DeepStack injection)."""
        return mx.where(self.mask, h + features[self.index].astype(h.dtype), h)
