"""Gemma 3 image preprocessing and image-placeholder expansion, without torch.

Matches transformers 5 ``Gemma3ImageProcessorPil`` (what ``Gemma3ImageProcessor`` falls back to
without torchvision) as ``Gemma3Processor`` drives it:

* RGB conversion (transparency composited onto white; ``do_convert_rgb`` is null in hub files
  and the processor defaults it on);
* with ``do_pan_and_scan``: the image plus up to ``pan_and_scan_max_num_crops`` crops along its
  long side when its aspect ratio reaches ``pan_and_scan_min_ratio_to_activate``;
* each image (and crop) resized through PIL on uint8 to ``size`` (896x896 for the hub models,
  ``resample`` 2 = bilinear), ``x * rescale_factor`` in float64 cast to float32, then
  ``(x - mean) / std`` in float32 (mean = std = 0.5).

The prompt: the chat template renders each image as ``<start_of_image>`` (``boi_token``);
each becomes ``"\\n\\n<start_of_image>" + image_seq_length * "<image_soft_token>" +
"<end_of_image>\\n\\n"`` in the *text*, which is then tokenized (newline runs are single tokens,
so expanding ids would tokenize differently). With crops it becomes ``"Here is the original
image " + seq + " and here are some crops to help you see better " + " ".join(crops * [seq])``.

Files: ``preprocessor_config.json`` (transformers 5 may nest it as ``image_processor`` in
``processor_config.json``) and ``processor_config.json`` (``image_seq_length``, which must equal
config.json's ``mm_tokens_per_image``). Token strings come from the tokenizer's
``boi_token`` / ``eoi_token`` / ``image_token``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mlxc.runtime.checkpoint.pixtral_preprocess import processor_files, to_rgb

IMAGENET_STANDARD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class Gemma3ProcessorConfig:
    """Defaults: ``Gemma3ImageProcessorPil``'s class values and ``Gemma3Processor``'s kwargs
    defaults (the hub files hold null for those).

    The pan-and-scan settings are never read from the files: ``Gemma3Processor`` passes its own
    (off, 256, 4, 1.2) over whatever preprocessor_config.json says, so a file's
    ``do_pan_and_scan: true`` changes nothing there either. ``do_pan_and_scan=True`` here does
    what ``processor(..., do_pan_and_scan=True)`` does.
    """

    height: int = 224
    width: int = 224
    resample: int = Image.Resampling.BILINEAR
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = IMAGENET_STANDARD
    image_std: tuple[float, ...] = IMAGENET_STANDARD
    do_pan_and_scan: bool = False
    pan_and_scan_min_crop_size: int = 256
    pan_and_scan_max_num_crops: int = 4
    pan_and_scan_min_ratio_to_activate: float = 1.2
    image_seq_length: int = 256

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Gemma3ProcessorConfig:
        proc, pre, model = processor_files(path)

        def get(key: str, default: Any) -> Any:
            value = pre.get(key)
            return default if value is None else value

        size = pre.get("size") or {}
        if not {"height", "width"} <= set(size) and size:
            raise ValueError(
                f"{path}: Gemma 3 resizes to a fixed size {{height, width}}, got size {size}"
            )
        mm_tokens = model.get("mm_tokens_per_image")
        seq = proc.get("image_seq_length", mm_tokens)
        seq = cls.image_seq_length if seq is None else int(seq)
        if mm_tokens is not None and seq != int(mm_tokens):
            raise ValueError(
                f"{path}: processor_config.json image_seq_length {seq} != config.json "
                f"mm_tokens_per_image {mm_tokens}"
            )
        return cls(
            height=int(size.get("height", cls.height)),
            width=int(size.get("width", cls.width)),
            resample=int(get("resample", cls.resample)),
            do_resize=bool(get("do_resize", cls.do_resize)),
            do_rescale=bool(get("do_rescale", cls.do_rescale)),
            rescale_factor=float(get("rescale_factor", cls.rescale_factor)),
            do_normalize=bool(get("do_normalize", cls.do_normalize)),
            image_mean=tuple(get("image_mean", cls.image_mean)),
            image_std=tuple(get("image_std", cls.image_std)),
            image_seq_length=seq,
        )


# --- images ---------------------------------------------------------------------------------


def pan_and_scan_boxes(height: int, width: int, cfg: Gemma3ProcessorConfig) -> list[tuple]:
    """``(top, left, bottom, right)`` of each crop of a ``height x width`` image (none when the
    aspect ratio is below the threshold or the crops would be below the minimum size)."""
    long, short = max(width, height), min(width, height)
    if long / short < cfg.pan_and_scan_min_ratio_to_activate:
        return []
    n = math.floor(long / short + 0.5)  # about the aspect ratio, rounded half up
    n = min(long // cfg.pan_and_scan_min_crop_size, n)
    n = min(cfg.pan_and_scan_max_num_crops, max(2, n))
    rows, cols = (1, n) if width >= height else (n, 1)
    crop_h, crop_w = math.ceil(height / rows), math.ceil(width / cols)
    if min(crop_h, crop_w) < cfg.pan_and_scan_min_crop_size:
        return []
    return [
        (r * crop_h, c * crop_w, min((r + 1) * crop_h, height), min((c + 1) * crop_w, width))
        for r in range(rows)
        for c in range(cols)
    ]


def _normalize(pixels: np.ndarray, cfg: Gemma3ProcessorConfig) -> np.ndarray:
    """uint8 ``[h, w, 3]`` -> float32 ``[3, h, w]``."""
    x = pixels
    if cfg.do_rescale:
        x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    x = x.astype(np.float32)
    if cfg.do_normalize:
        mean = np.asarray(cfg.image_mean, dtype=np.float32)
        std = np.asarray(cfg.image_std, dtype=np.float32)
        x = (x - mean) / std
    return x.transpose(2, 0, 1)


def preprocess_image(image: Image.Image, cfg: Gemma3ProcessorConfig) -> list[np.ndarray]:
    """One image -> float32 ``[3, height, width]`` arrays: the image, then its crops."""
    image = to_rgb(image)
    crops = [np.asarray(image)]
    if cfg.do_pan_and_scan:
        crops += [crops[0][t:b, l:r] for t, l, b, r in pan_and_scan_boxes(*crops[0].shape[:2], cfg)]
    out = []
    for pixels in crops:
        if cfg.do_resize:
            # transformers resizes the uint8 image through PIL (size is (width, height) there).
            pixels = Image.fromarray(pixels).resize((cfg.width, cfg.height), cfg.resample)
        out.append(_normalize(np.asarray(pixels), cfg))
    return out


def preprocess_images(
    images: Image.Image | Sequence[Image.Image], cfg: Gemma3ProcessorConfig
) -> tuple[np.ndarray, list[int]]:
    """``(pixel_values float32 [N, 3, height, width], crops per image)``: each image followed
    by its crops, as ``Gemma3ImageProcessor`` returns them (``num_crops``)."""
    if isinstance(images, Image.Image):
        images = [images]
    arrays, num_crops = [], []
    for image in images:
        parts = preprocess_image(image, cfg)
        arrays += parts
        num_crops.append(len(parts) - 1)
    if not arrays:
        return np.zeros((0, 3, cfg.height, cfg.width), dtype=np.float32), num_crops
    return np.stack(arrays), num_crops


# --- prompt ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gemma3Tokens:
    boi: str = "<start_of_image>"
    eoi: str = "<end_of_image>"
    image: str = "<image_soft_token>"

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> Gemma3Tokens:
        """The tokenizer's ``boi_token`` / ``eoi_token`` / ``image_token`` (tokenizer_config.json
        ``extra_special_tokens``), else Gemma 3's strings."""

        def named(attr: str, default: str) -> str:
            value = getattr(tokenizer, attr, None)
            return value if isinstance(value, str) and value else default

        return cls(
            named("boi_token", cls.boi),
            named("eoi_token", cls.eoi),
            named("image_token", cls.image),
        )

    def image_sequence(self, seq_length: int) -> str:
        return f"\n\n{self.boi}{self.image * seq_length}{self.eoi}\n\n"


def expand_image_text(
    text: str, num_crops: Sequence[int], tokens: Gemma3Tokens, seq_length: int
) -> str:
    """Replace the i-th ``boi`` in ``text`` with image i's sequence (and its crops')."""
    parts = text.split(tokens.boi)
    if len(parts) - 1 != len(num_crops):
        raise ValueError(
            f"the prompt has {len(parts) - 1} image placeholders for {len(num_crops)} images"
        )
    seq = tokens.image_sequence(seq_length)
    out = parts[0]
    for crops, part in zip(num_crops, parts[1:]):
        if crops:
            seq_i = (
                f"Here is the original image {seq} and here are some crops to help you see "
                "better " + " ".join([seq] * crops)
            )
        else:
            seq_i = seq
        out += seq_i + part
    return out


def token_ids(tokenizer: Any, tokens: Gemma3Tokens, config: dict | None = None) -> dict[str, int]:
    """``{"boi", "eoi", "image"}`` ids from the tokenizer, checked against config.json's
    ``image_token_index`` / ``boi_token_index`` / ``eoi_token_index`` where it has them."""
    ids = {}
    unk = getattr(tokenizer, "unk_token_id", None)
    for key, name in (("boi", tokens.boi), ("eoi", tokens.eoi), ("image", tokens.image)):
        i = tokenizer.convert_tokens_to_ids(name)
        if i is None or (i == unk and name != getattr(tokenizer, "unk_token", None)):
            raise ValueError(f"the tokenizer has no {name} token")
        ids[key] = int(i)
    for key in ("image", "boi", "eoi"):
        want = (config or {}).get(f"{key}_token_index", (config or {}).get(f"{key}_token_id"))
        if want is not None and int(want) != ids[key]:
            raise ValueError(
                f"config.json {key}_token_index {want} != tokenizer id {ids[key]} of "
                f"{getattr(tokens, key)}"
            )
    return ids
