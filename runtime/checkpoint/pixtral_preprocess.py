"""Pixtral / Mistral-3 image preprocessing and ``[IMG]`` prompt expansion, without torchvision.

Matches transformers 5 ``PixtralImageProcessorPil`` (what ``PixtralImageProcessor`` falls back to
when torchvision is absent) as driven by ``PixtralProcessor``:

* RGB conversion (transparency composited onto white), then a PIL resize of the uint8 image
  (bicubic by default) so both sides fit ``longest_edge`` and are rounded *up* to multiples of
  ``patch_size * spatial_merge_size`` (the processor passes that product as the patch size);
* ``x * rescale_factor`` in float64, cast to float32, then ``(x - mean) / std`` in float32;
* zero padding at the bottom/right to the batch's largest height and width.

The prompt gets, per image, ``rows`` lines of ``cols`` ``[IMG]`` tokens each followed by
``[IMG_BREAK]``, the very last ``[IMG_BREAK]`` replaced by ``[IMG_END]``, where
``rows, cols = height // (patch_size * spatial_merge_size), width // (...)``.

Checkpoint files: ``preprocessor_config.json`` (image_mean/std, size.longest_edge, patch_size,
resample, rescale_factor) and ``processor_config.json`` (patch_size, spatial_merge_size and the
three token strings); transformers 5 may nest the former under ``image_processor`` in the latter.
Token ids come from the tokenizer (``convert_tokens_to_ids``); config.json's
``image_token_index`` (saved under that name, ``image_token_id`` is an alias) must equal
``[IMG]``'s id. ``[IMG_BREAK]`` / ``[IMG_END]`` ids are only in the tokenizer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class PixtralProcessorConfig:
    patch_size: int = 16  # the vision tower's patch size
    spatial_merge_size: int = 1  # PixtralProcessor's default; Mistral-Small checkpoints use 2
    longest_edge: int = 1024
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC
    image_token: str = "[IMG]"
    image_break_token: str = "[IMG_BREAK]"
    image_end_token: str = "[IMG_END]"

    @property
    def resize_multiple(self) -> int:
        return self.patch_size * self.spatial_merge_size

    @classmethod
    def from_pretrained(cls, path: str | Path) -> PixtralProcessorConfig:
        """Read ``processor_config.json`` and ``preprocessor_config.json`` in ``path``; missing
        values fall back to ``config.json`` (patch/merge sizes) and then to the defaults above."""
        proc, pre, model = processor_files(path)
        vision = model.get("vision_config") or {}

        def pick(*values: Any, default: Any) -> Any:
            return next((v for v in values if v is not None), default)

        patch = pick(proc.get("patch_size"), vision.get("patch_size"), default=None)
        if patch is None:  # the image processor's own patch_size (an int or {"height", "width"})
            p = pre.get("patch_size", cls.patch_size)
            patch = p["height"] if isinstance(p, dict) else p
        size = pre.get("size") or {}
        return cls(
            patch_size=int(patch),
            spatial_merge_size=int(
                pick(
                    proc.get("spatial_merge_size"),
                    model.get("spatial_merge_size"),
                    default=cls.spatial_merge_size,
                )
            ),
            longest_edge=int(size.get("longest_edge", cls.longest_edge)),
            image_mean=tuple(pre.get("image_mean", CLIP_MEAN)),
            image_std=tuple(pre.get("image_std", CLIP_STD)),
            rescale_factor=float(pre.get("rescale_factor", cls.rescale_factor)),
            resample=int(pre.get("resample", cls.resample)),
            image_token=proc.get("image_token", cls.image_token),
            image_break_token=proc.get("image_break_token", cls.image_break_token),
            image_end_token=proc.get("image_end_token", cls.image_end_token),
        )


# --- images ---------------------------------------------------------------------------------


def processor_files(path: str | Path) -> tuple[dict, dict, dict]:
    """``processor_config.json``, the image-processor settings (``preprocessor_config.json``
    over the processor file's ``image_processor``) and ``config.json`` of a checkpoint; a
    missing file reads as empty."""
    path = Path(path)

    def load(name: str) -> dict:
        f = path / name
        return json.loads(f.read_text()) if f.is_file() else {}

    proc, pre = load("processor_config.json"), load("preprocessor_config.json")
    return proc, {**(proc.get("image_processor") or {}), **pre}, load("config.json")


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (as transformers' ``convert_to_rgb``)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def resized_size(height: int, width: int, longest_edge: int, multiple: int) -> tuple[int, int]:
    """Target ``(height, width)``: shrink (never enlarge) to fit ``longest_edge`` with floor
    rounding, then round each side *up* to a multiple of ``multiple``."""
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        height, width = math.floor(height / ratio), math.floor(width / ratio)
    return (
        ((height - 1) // multiple + 1) * multiple,
        ((width - 1) // multiple + 1) * multiple,
    )


def preprocess_image(image: Image.Image, cfg: PixtralProcessorConfig) -> np.ndarray:
    """One image -> float32 ``[3, h, w]`` (unpadded)."""
    image = to_rgb(image)
    h, w = resized_size(image.height, image.width, cfg.longest_edge, cfg.resize_multiple)
    # transformers resizes the uint8 image through PIL (size is (width, height) there).
    pixels = np.asarray(image.resize((w, h), resample=cfg.resample))
    x = (pixels.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    mean = np.asarray(cfg.image_mean, dtype=np.float32)
    std = np.asarray(cfg.image_std, dtype=np.float32)
    return ((x - mean) / std).transpose(2, 0, 1)


def preprocess_images(
    images: Image.Image | Sequence[Image.Image], cfg: PixtralProcessorConfig
) -> tuple[np.ndarray, np.ndarray]:
    """``(pixel_values float32 [N, 3, H_max, W_max], image_sizes int64 [N, 2])``.

    ``image_sizes`` holds each image's resized (height, width) before the zero padding to the
    batch maximum; the vision tower crops each image back to it.
    """
    if isinstance(images, Image.Image):
        images = [images]
    arrays = [preprocess_image(im, cfg) for im in images]
    sizes = np.array([a.shape[1:] for a in arrays], dtype=np.int64).reshape(-1, 2)
    H, W = sizes.max(axis=0) if len(arrays) else (0, 0)
    out = np.zeros((len(arrays), 3, H, W), dtype=np.float32)
    for i, a in enumerate(arrays):
        out[i, :, : a.shape[1], : a.shape[2]] = a
    return out, sizes


# --- prompt ---------------------------------------------------------------------------------


def image_token_grid(
    image_size: Sequence[int], patch_size: int, spatial_merge_size: int
) -> tuple[int, int]:
    """``(rows, cols)`` of ``[IMG]`` tokens for an image of processed size ``(height, width)``."""
    k = patch_size * spatial_merge_size
    return int(image_size[0]) // k, int(image_size[1]) // k


def image_placeholder(rows: int, cols: int, img: Any, brk: Any, end: Any) -> list:
    """``rows`` x (``cols`` * img + brk), the last brk replaced by end."""
    out = ([img] * cols + [brk]) * rows
    out[-1] = end
    return out


def expand_image_tokens(
    tokens: str | Sequence[int],
    image_sizes: Any,
    patch_size: int,
    spatial_merge_size: int,
    img_token_id: int | str,
    img_break_id: int | str,
    img_end_id: int | str,
) -> str | list[int]:
    """Replace the i-th image placeholder in ``tokens`` with image i's token block.

    ``tokens`` is a list of token ids (then the three ids are ints) or a text (then they are the
    token strings, e.g. ``"[IMG]"``, as ``PixtralProcessor`` does before tokenizing). Both give
    the same ids after tokenization; expanding ids avoids re-tokenizing. ``image_sizes``
    ``[N, 2]`` are the processed sizes from :func:`preprocess_images`. The number of
    placeholders must equal the number of images.
    """
    sizes = np.asarray(image_sizes).reshape(-1, 2).tolist()
    blocks = [
        image_placeholder(
            *image_token_grid(s, patch_size, spatial_merge_size),
            img_token_id,
            img_break_id,
            img_end_id,
        )
        for s in sizes
    ]
    if isinstance(tokens, str):
        if not all(isinstance(t, str) for t in (img_token_id, img_break_id, img_end_id)):
            raise TypeError("for a text prompt give the token strings, e.g. '[IMG]'")
        parts = tokens.split(img_token_id)
        _check_count(len(parts) - 1, len(blocks))
        out = parts[0]
        for block, part in zip(blocks, parts[1:]):
            out += "".join(block) + part
        return out
    ids = [int(t) for t in tokens]
    _check_count(ids.count(img_token_id), len(blocks))
    result: list[int] = []
    it = iter(blocks)
    for t in ids:
        result.extend(next(it) if t == img_token_id else (t,))
    return result


def _check_count(placeholders: int, images: int) -> None:
    if placeholders != images:
        raise ValueError(f"the prompt has {placeholders} image placeholders for {images} images")


def image_token_ids(
    tokenizer: Any, cfg: PixtralProcessorConfig, config: dict | None = None
) -> tuple[int, int, int]:
    """``([IMG], [IMG_BREAK], [IMG_END])`` ids from a Hugging Face tokenizer, as
    ``PixtralProcessor`` reads them; checked against config.json's ``image_token_index``."""
    names = (cfg.image_token, cfg.image_break_token, cfg.image_end_token)
    ids = tuple(tokenizer.convert_tokens_to_ids(n) for n in names)
    unk = getattr(tokenizer, "unk_token_id", None)
    for n, i in zip(names, ids):
        if i is None or (i == unk and n != getattr(tokenizer, "unk_token", None)):
            raise ValueError(f"the tokenizer has no {n} token")
    if config is not None:
        want = config.get("image_token_index", config.get("image_token_id"))
        if want is not None and int(want) != ids[0]:
            raise ValueError(
                f"config.json image_token_index {want} != tokenizer id {ids[0]} of {names[0]}"
            )
    return ids  # type: ignore[return-value]
