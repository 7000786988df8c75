"""Chat messages + images -> prompt ids and the model's vision inputs.

``load_processor(path, tokenizer, tower)`` picks the preprocessing of the model's vision tower
(the generated module's ``VISION_TOWER``):

* ``qwen2_vit`` / ``qwen2_5_vit`` / ``qwen3_vit``: transformers' ``Qwen2VLImageProcessorPil``
  (the PIL backend, no torchvision; transformers 5 maps qwen2_vl, qwen2_5_vl and qwen3_vl all to
  it), configured from ``preprocessor_config.json``. Each image placeholder
  ``<|image_pad|>`` (config.json ``image_token_id``) becomes ``t*h*w / merge_size**2`` copies,
  as ``Qwen2VLProcessor`` / ``Qwen3VLProcessor`` expand it. Vision inputs: ``pixel_values``
  float32 ``[N_patches, C*T*P*P]`` and ``image_grid_thw`` int64 ``[N_images, 3]``.
* ``pixtral``: :mod:`mlxc.runtime.checkpoint.pixtral_preprocess` (matches transformers'
  ``PixtralImageProcessorPil`` + ``PixtralProcessor``). Each ``[IMG]`` becomes rows of ``[IMG]``
  with ``[IMG_BREAK]`` after each row, the last one ``[IMG_END]``. Vision inputs:
  ``pixel_values`` float32 ``[N, 3, H, W]`` and ``image_sizes`` int64 ``[N, 2]``.
* ``gemma3_siglip``: :mod:`mlxc.runtime.checkpoint.gemma3_preprocess` (matches transformers'
  ``Gemma3ImageProcessorPil`` + ``Gemma3Processor``). Each ``<start_of_image>`` becomes
  ``\\n\\n<start_of_image>``, ``image_seq_length`` ``<image_soft_token>`` and
  ``<end_of_image>\\n\\n`` in the text before it is tokenized (pan-and-scan crops add their own
  sequences). Vision inputs: ``pixel_values`` float32 ``[N, 3, H, W]`` (images and crops).
* None (a text-only model): messages render as usual; any image is an :class:`ImageInputError`.

Messages are chat messages whose ``content`` is a string or a list of OpenAI-style parts:
``{"type": "text", "text": ...}`` and image placeholders ``{"type": "image"}`` /
``{"type": "image_url", ...}`` / ``{"type": "input_image", ...}``; the caller decodes the images
(:func:`load_image`; :func:`image_size` reads only the header) and passes them in placeholder
order. The chat template (:func:`chat_template_for`) renders image parts as the model's
placeholder; without any template the placeholders go before each message's text. A template
that fails raises ``ChatTemplateError`` (a ValueError) naming the template.

No torch and no MLX here: transformers' image processor runs on numpy, and the vision inputs
stay numpy arrays. Prompts are built on the server's event-loop thread; MLX arrays are made on
the thread that runs the model (``runtime.serving.generate.as_model_inputs``).
"""

from __future__ import annotations

import functools
import io
import json
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, BinaryIO

import numpy as np
from PIL import Image

from mlxc.runtime.checkpoint.tokenizer import (
    OVERRIDE_SOURCE,
    render_chat_template,
    tokenizer_template_source,
)

IMAGE_PART_TYPES = ("image", "image_url", "input_image")

# Decompression-bomb guard: PIL's own default (~89.5 megapixels, 0.25 GiB of RGBA). Checked from
# the header before any pixel is decoded. PIL itself only warns between 1x and 2x its limit.
MAX_IMAGE_PIXELS = 89_478_485


class ImageInputError(ValueError):
    """An image that cannot be used: unreadable, undecodable, too large, or images given to a
    model that takes none, or a prompt whose placeholders do not match the images."""


# --- images ---------------------------------------------------------------------------------


ImageSource = str | Path | bytes | BinaryIO


@contextmanager
def _open_image(source: ImageSource) -> Iterator[tuple[Image.Image, str]]:
    """The image with only its header read (PIL opens lazily) and its name for messages; PIL's
    errors become :class:`ImageInputError`. The file is closed on exit."""
    name = str(source) if isinstance(source, str | Path) else "image data"
    if isinstance(source, bytes | bytearray):
        source = io.BytesIO(source)
    try:
        # Our own limit is checked by the callers; PIL's check (its error above 2x its limit)
        # stays on.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(source)
    except FileNotFoundError as e:
        raise ImageInputError(f"cannot read image {name}: no such file") from e
    except IsADirectoryError as e:
        raise ImageInputError(f"cannot read image {name}: it is a directory") from e
    except Image.DecompressionBombError as e:
        raise ImageInputError(f"image {name} is too large: {e}") from e
    except Image.UnidentifiedImageError as e:
        raise ImageInputError(f"cannot decode image {name}: not an image format PIL reads") from e
    except OSError as e:
        raise ImageInputError(f"cannot read image {name}: {e.strerror or e}") from e
    with image:
        width, height = image.size
        if width < 1 or height < 1:
            raise ImageInputError(f"image {name} is empty ({width}x{height})")
        yield image, name


def image_size(source: ImageSource) -> tuple[int, int]:
    """``(width, height)`` of one image from its header, without decoding a pixel (a per-request
    pixel budget can be checked before any image is decoded).

    Raises :class:`ImageInputError` as :func:`load_image` does for a missing, unreadable or
    unidentifiable file (and for a header PIL itself refuses, above twice
    :data:`MAX_IMAGE_PIXELS`). A file object is read from its current position.
    """
    with _open_image(source) as (image, _):
        return image.size


def load_image(source: ImageSource, *, max_pixels: int | None = None) -> Image.Image:
    """Open and fully decode one image (a path, raw bytes or a binary file object).

    Raises :class:`ImageInputError` when the file is missing or unreadable, is not an image PIL
    can decode (or is truncated), or has more than ``max_pixels`` pixels (checked from the
    header, before decoding; None: :data:`MAX_IMAGE_PIXELS`). Animated images give their first
    frame.
    """
    max_pixels = MAX_IMAGE_PIXELS if max_pixels is None else max_pixels
    with _open_image(source) as (image, name):
        width, height = image.size
        if width * height > max_pixels:
            raise ImageInputError(
                f"image {name} is too large: {width}x{height} = {width * height} pixels, "
                f"the limit is {max_pixels}"
            )
        try:
            image.load()
            # A copy owns its pixels: the file is closed and multi-frame images keep frame 0.
            return image.copy()
        except Exception as e:  # decoders raise OSError, ValueError, SyntaxError, EOFError...
            raise ImageInputError(f"cannot decode image {name}: {e}") from e


# --- messages -------------------------------------------------------------------------------


@dataclass
class Prompt:
    """Token ids of a prompt (image placeholders expanded) and the model's vision inputs for its
    first prefill chunk (None without images): numpy arrays, made MLX arrays by whoever runs the
    model (``runtime.serving.generate.as_model_inputs``)."""

    ids: list[int]
    vision: dict[str, np.ndarray] | None = None


def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def normalize_messages(messages: Sequence[dict]) -> tuple[list[dict], int]:
    """Messages for the chat template, and their number of image parts.

    Image parts become ``{"type": "image"}`` (the form transformers' VL templates render, and
    without the image data: a base64 URL has no business in the template); text parts keep
    their text. Other part types raise ValueError.
    """
    out, n_images = [], 0
    for i, message in enumerate(messages):
        # Malformed messages are user data: ValueError, as for bad parts.
        is_mapping = isinstance(message, dict)
        content = message.get("content") if is_mapping else None
        if is_mapping and (content is None or isinstance(content, str)):
            out.append(dict(message))
            continue
        if not is_mapping or not isinstance(content, list):
            got = type(content if is_mapping else message).__name__
            raise ValueError(
                f"message {i}: must be a mapping whose content is a string or a list of parts, "
                f"got a {got}"
            )
        parts = []
        for part in content:
            if _is_image_part(part):
                parts.append({"type": "image"})
                n_images += 1
            elif isinstance(part, dict) and part.get("type") == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"message {i}: unsupported content part {kind!r}")
        out.append({**message, "content": parts})
    return out, n_images


def _text_of(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p["text"] for p in content if p.get("type") == "text")


def _processor_template(path: Path) -> tuple[str, str] | None:
    """The processor's own chat template and its file: chat_template.json, else
    chat_template.jinja, the order transformers' ``ProcessorMixin.get_processor_dict`` reads
    them in."""
    template = _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(template, str) and template:
        return template, "chat_template.json"
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(), "chat_template.jinja"
    return None


def chat_template_for(
    path: str | Path, tokenizer: Any, *, override: str | None = None, vision: bool = False
) -> tuple[str | None, str]:
    """The chat template a processor renders with (None: the tokenizer's own) and where it
    comes from (named in errors).

    ``override`` (``--chat-template``) comes first. A VL processor (``vision``) then takes the
    processor's template, as transformers' ``AutoProcessor`` does: Qwen2.5-VL ships a text-only
    template in tokenizer_config.json and the VL one in chat_template.json. A text model takes
    the tokenizer's (``AutoTokenizer``), the processor's file only when the tokenizer has none.
    """
    if override is not None:
        return override, OVERRIDE_SOURCE
    if vision or not getattr(tokenizer, "chat_template", None):
        found = _processor_template(Path(path))
        if found is not None:
            return found
    return None, tokenizer_template_source(tokenizer)


class Processor:
    """Renders messages, expands image placeholders, and makes the vision inputs.

    Subclasses set ``placeholder`` (the text one image part renders to without a chat
    template), ``image_token_id`` (the id whose occurrences are expanded, one per image), and
    implement ``_vision`` (images -> vision inputs and the per-image expansion, of the ids or,
    with ``expands_text``, of the text before it is tokenized).
    """

    placeholder: str = ""
    image_token_id: int | None = None
    takes_images = True
    expands_text = False  # True: ``_vision``'s expansion maps the prompt text, not its ids

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None = None,
        template_source: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # None: the tokenizer's own
        # The template's name in errors (None: the tokenizer's file).
        self.template_source = template_source or (
            OVERRIDE_SOURCE if chat_template else tokenizer_template_source(tokenizer)
        )

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template or getattr(self.tokenizer, "chat_template", None))

    # -- text ----------------------------------------------------------------------------

    def render(
        self,
        messages: Sequence[dict],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
    ) -> str:
        """The chat template's text for normalised ``messages`` (``ChatTemplateError``, a
        ValueError naming the template, when it fails); ``template_kwargs``: its extra
        variables."""
        return render_chat_template(
            self.tokenizer,
            messages,
            chat_template=self.chat_template,
            source=self.template_source,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=template_kwargs,
        )

    def _prompt_text(
        self,
        messages: list[dict],
        use_template: bool,
        add_generation_prompt: bool,
        template_kwargs: dict | None = None,
    ) -> tuple[str, bool]:
        """The prompt's text and whether encoding it adds the tokenizer's special tokens."""
        if use_template:
            # The template writes BOS and the other special tokens itself.
            text = self.render(
                messages,
                add_generation_prompt=add_generation_prompt,
                template_kwargs=template_kwargs,
            )
            return text, False
        # No template: each message's image placeholders, then its text.
        pieces = []
        for m in messages:
            content = m.get("content")
            n = sum(1 for p in content if _is_image_part(p)) if isinstance(content, list) else 0
            pieces.append(self.placeholder * n + _text_of(content))
        return "\n".join(pieces), True

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    # -- public --------------------------------------------------------------------------

    def encode(
        self,
        messages: Sequence[dict],
        images: Sequence[Image.Image] = (),
        *,
        chat_template: bool | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
    ) -> Prompt:
        """Prompt ids and vision inputs for ``messages`` with ``images`` (PIL, in the order of
        the messages' image parts); ``template_kwargs``: the chat template's extra variables.

        ``chat_template``: None renders the chat template when there is one; False skips it
        (placeholders before each message's text, the tokenizer's usual BOS); True requires it.
        """
        images = list(images)
        normalized, n_parts = normalize_messages(messages)
        if images and not self.takes_images:
            raise ImageInputError(self.no_images_reason)
        if n_parts != len(images):
            raise ImageInputError(
                f"the messages have {n_parts} image part(s) for {len(images)} image(s)"
            )
        use_template = self.has_chat_template if chat_template is None else chat_template
        if use_template and not self.has_chat_template:
            raise ValueError("the tokenizer has no chat template; encode without it")
        text, special = self._prompt_text(
            normalized, use_template, add_generation_prompt, template_kwargs
        )
        ids = self._encode(text, special)
        if not images:
            return Prompt(ids)
        found = ids.count(self.image_token_id)
        if found != len(images):
            token = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
            why = " (the chat template does not render image parts)" if found == 0 else ""
            raise ImageInputError(
                f"the prompt has {found} image placeholder(s) {token} (id "
                f"{self.image_token_id}) for {len(images)} image(s){why}"
            )
        vision, expand = self._vision(images)
        if self.expands_text:  # the placeholders expand in the text, which is tokenized again
            return Prompt(self._encode(expand(text), special), vision)
        return Prompt(expand(ids), vision)

    def encode_text_and_images(
        self,
        text: str,
        images: Sequence[Image.Image] = (),
        *,
        chat_template: bool | None = None,
    ) -> Prompt:
        """One user message: the images, then ``text``."""
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        return self.encode(
            [{"role": "user", "content": content if images else text}],
            images,
            chat_template=chat_template,
        )

    # -- per tower -----------------------------------------------------------------------

    no_images_reason = "this model takes no images"

    def _vision(self, images: list[Image.Image]) -> tuple[dict[str, np.ndarray], Any]:
        raise NotImplementedError


class TextProcessor(Processor):
    """A text-only model: messages render as usual, images are refused."""

    takes_images = False

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None = None,
        template_source: str | None = None,
        name: str = "",
    ) -> None:
        super().__init__(tokenizer, chat_template, template_source)
        what = f"the {name} model" if name else "this model"
        self.no_images_reason = f"{what} takes no images (it has no vision tower)"


def _image_error(index: int, e: Exception) -> ImageInputError:
    return ImageInputError(f"image {index + 1} cannot be preprocessed: {e}")


# --- Qwen VL --------------------------------------------------------------------------------

# What transformers' Qwen2VLImageProcessorPil takes from preprocessor_config.json.
_QWEN_KEYS = (
    "do_resize",
    "size",
    "min_pixels",
    "max_pixels",
    "resample",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "do_convert_rgb",
    "patch_size",
    "temporal_patch_size",
    "merge_size",
)
# Without a preprocessor_config.json: transformers' class defaults, except Qwen3-VL, whose hub
# checkpoints all ship these (the class defaults are Qwen2-VL's CLIP mean/std and sizes).
_QWEN3_DEFAULTS = {
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
# transformers' Qwen2VLConfig defaults when config.json omits the ids.
_QWEN_TOKEN_DEFAULTS = {
    "image_token_id": 151655,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if isinstance(value, dict):
        return value
    raise ValueError(f"{path} must hold a JSON object")


def qwen_image_processor_kwargs(path: str | Path, tower: str) -> dict[str, Any]:
    """Keyword arguments of ``Qwen2VLImageProcessorPil`` for the checkpoint at ``path``.

    ``preprocessor_config.json`` (or ``processor_config.json``'s ``image_processor``, as
    transformers 5 may nest it) gives the values; hub files use top-level ``min_pixels`` /
    ``max_pixels`` (Qwen2/2.5-VL) or ``size: {shortest_edge, longest_edge}`` (Qwen3-VL,
    transformers 5). Missing patch/merge/temporal sizes come from config.json's
    ``vision_config``, and must agree with it when given.
    """
    path = Path(path)
    pre = {
        **(_read_json(path / "processor_config.json").get("image_processor") or {}),
        **_read_json(path / "preprocessor_config.json"),
    }
    kwargs = {k: pre[k] for k in _QWEN_KEYS if pre.get(k) is not None}
    if tower == "qwen3_vit":
        for k, v in _QWEN3_DEFAULTS.items():
            if k not in kwargs and not (k == "size" and {"min_pixels", "max_pixels"} & set(pre)):
                kwargs[k] = v
    size = kwargs.get("size")
    if isinstance(size, dict) and ({"min_pixels", "max_pixels"} & set(size)):
        # An older form: size {min_pixels, max_pixels}.
        size = dict(size)
        if "min_pixels" in size:
            size.setdefault("shortest_edge", size.pop("min_pixels"))
        if "max_pixels" in size:
            size.setdefault("longest_edge", size.pop("max_pixels"))
        kwargs["size"] = size
    vision = _read_json(path / "config.json").get("vision_config") or {}
    for key, vkey in (
        ("patch_size", "patch_size"),
        ("merge_size", "spatial_merge_size"),
        ("temporal_patch_size", "temporal_patch_size"),
    ):
        if vision.get(vkey) is None:
            continue
        if key not in kwargs:
            kwargs[key] = int(vision[vkey])
        elif int(kwargs[key]) != int(vision[vkey]):
            raise ValueError(
                f"{path}: preprocessor_config.json {key} {kwargs[key]} != config.json "
                f"vision_config {vkey} {vision[vkey]}"
            )
    return kwargs


class QwenProcessor(Processor):
    def __init__(
        self,
        path: str | Path,
        tokenizer: Any,
        chat_template: str | None = None,
        template_source: str | None = None,
        *,
        tower: str,
    ) -> None:
        super().__init__(tokenizer, chat_template, template_source)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        self.image_processor = Qwen2VLImageProcessorPil(**qwen_image_processor_kwargs(path, tower))
        self.merge_size = int(self.image_processor.merge_size)
        config = _read_json(Path(path) / "config.json")
        ids = {k: config.get(k, v) for k, v in _QWEN_TOKEN_DEFAULTS.items()}
        self.image_token_id = int(ids["image_token_id"])
        vocab = tokenizer.convert_ids_to_tokens(
            [ids["vision_start_token_id"], self.image_token_id, ids["vision_end_token_id"]]
        )
        if any(t is None for t in vocab):
            raise ValueError(
                f"{path}: the tokenizer lacks the image tokens of config.json (ids "
                f"{ids['vision_start_token_id']}, {self.image_token_id}, "
                f"{ids['vision_end_token_id']})"
            )
        self.placeholder = "".join(vocab)  # <|vision_start|><|image_pad|><|vision_end|>

    def _vision(self, images):
        for i, image in enumerate(images):
            h, w = image.height, image.width
            if max(h, w) / min(h, w) > 200:
                raise _image_error(i, ValueError(f"aspect ratio of {w}x{h} is above 200"))
        try:
            out = self.image_processor(images=images, return_tensors="np")
        except ValueError as e:
            raise ImageInputError(f"images cannot be preprocessed: {e}") from e
        pixel_values = np.asarray(out["pixel_values"], dtype=np.float32)
        grid = np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
        counts = [int(n) for n in grid.prod(axis=1) // self.merge_size**2]
        image = self.image_token_id

        def expand(ids: list[int]) -> list[int]:
            out_ids: list[int] = []
            it = iter(counts)
            for t in ids:
                out_ids.extend([image] * next(it) if t == image else (t,))
            return out_ids

        return {"pixel_values": pixel_values, "image_grid_thw": grid}, expand


# --- Pixtral (Mistral 3) --------------------------------------------------------------------


class PixtralProcessor(Processor):
    def __init__(
        self,
        path: str | Path,
        tokenizer: Any,
        chat_template: str | None = None,
        template_source: str | None = None,
    ) -> None:
        super().__init__(tokenizer, chat_template, template_source)
        from mlxc.runtime.checkpoint import pixtral_preprocess as pp

        self.cfg = pp.PixtralProcessorConfig.from_pretrained(path)
        config = _read_json(Path(path) / "config.json")
        self.token_ids = pp.image_token_ids(tokenizer, self.cfg, config)
        self.image_token_id = self.token_ids[0]
        self.placeholder = self.cfg.image_token

    def _vision(self, images):
        from mlxc.runtime.checkpoint import pixtral_preprocess as pp

        cfg = self.cfg
        try:
            pixel_values, sizes = pp.preprocess_images(images, cfg)
        except (ValueError, OSError) as e:
            raise ImageInputError(f"images cannot be preprocessed: {e}") from e

        def expand(ids: list[int]) -> list[int]:
            return pp.expand_image_tokens(
                ids, sizes, cfg.patch_size, cfg.spatial_merge_size, *self.token_ids
            )

        return {"pixel_values": pixel_values, "image_sizes": sizes}, expand


# --- Gemma 3 --------------------------------------------------------------------------------


class Gemma3Processor(Processor):
    """``Gemma3Processor``: each ``<start_of_image>`` the template renders becomes the image's
    soft-token sequence in the text (:mod:`mlxc.runtime.checkpoint.gemma3_preprocess`)."""

    expands_text = True

    def __init__(
        self,
        path: str | Path,
        tokenizer: Any,
        chat_template: str | None = None,
        template_source: str | None = None,
    ) -> None:
        super().__init__(tokenizer, chat_template, template_source)
        from mlxc.runtime.checkpoint import gemma3_preprocess as gp

        self.cfg = gp.Gemma3ProcessorConfig.from_pretrained(path)
        self.tokens = gp.Gemma3Tokens.from_tokenizer(tokenizer)
        ids = gp.token_ids(tokenizer, self.tokens, _read_json(Path(path) / "config.json"))
        self.image_token_id = ids["boi"]  # one per image before expansion
        self.placeholder = self.tokens.boi

    def _vision(self, images):
        from mlxc.runtime.checkpoint import gemma3_preprocess as gp

        cfg = self.cfg
        try:
            pixel_values, num_crops = gp.preprocess_images(images, cfg)
        except (ValueError, OSError) as e:
            raise ImageInputError(f"images cannot be preprocessed: {e}") from e

        def expand(text: str) -> str:
            return gp.expand_image_text(text, num_crops, self.tokens, cfg.image_seq_length)

        return {"pixel_values": pixel_values}, expand


# --- sampling -------------------------------------------------------------------------------


# Vision tower (the names of compiler/vision.py's TOWERS; tests/test_processor.py checks that the
# two lists agree) -> the processor of its checkpoints.
PROCESSORS: dict[str, Callable[..., Processor]] = {
    "qwen2_vit": functools.partial(QwenProcessor, tower="qwen2_vit"),
    "qwen2_5_vit": functools.partial(QwenProcessor, tower="qwen2_5_vit"),
    "qwen3_vit": functools.partial(QwenProcessor, tower="qwen3_vit"),
    "pixtral": PixtralProcessor,
    "gemma3_siglip": Gemma3Processor,
}


def vision_tower(model_module_or_tower: Any) -> str | None:
    """The ``VISION_TOWER`` of a generated module (the processor is chosen before the model
    loads), the ``vision_tower`` of a model built from one, or the tower name itself (None: a
    text-only model)."""
    if model_module_or_tower is None or isinstance(model_module_or_tower, str):
        return model_module_or_tower
    if isinstance(model_module_or_tower, ModuleType):
        return getattr(model_module_or_tower, "VISION_TOWER", None)
    # A model loaded from a checkpoint without its tower says so on the instance (loading).
    model_class = type(model_module_or_tower)
    return vars(model_module_or_tower).get(
        "vision_tower", getattr(model_class, "vision_tower", None)
    )


def load_processor(
    path: str | Path,
    tokenizer: Any,
    model_module_or_tower: Any,
    *,
    chat_template: str | None = None,
) -> Processor:
    """The processor for the checkpoint at ``path``.

    ``model_module_or_tower``: the generated module (or a model built from one, or its
    ``VISION_TOWER`` string; None for a text model). ``chat_template``: a Jinja template used
    instead of the checkpoint's (``--chat-template``; :func:`chat_template_for` says which
    template is used otherwise). Raises ValueError on inconsistent checkpoint files (e.g. the
    tokenizer lacks the image tokens config.json names).
    """
    path = Path(path)
    tower = vision_tower(model_module_or_tower)
    if tower is not None and tower not in PROCESSORS:
        raise ValueError(f"no image preprocessing for vision tower {tower!r}")
    template = chat_template_for(path, tokenizer, override=chat_template, vision=tower is not None)
    if tower is None:
        name = _read_json(path / "config.json").get("model_type") or ""
        return TextProcessor(tokenizer, *template, name=str(name))
    return PROCESSORS[tower](path, tokenizer, *template)
