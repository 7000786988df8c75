"""Pixtral tower, Mistral-3 projector and preprocessing against transformers (CPU, float32)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import mlx.core as mx
import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.pixtral.image_processing_pil_pixtral import (
    PixtralImageProcessorPil,
    get_resize_output_image_size,
)

from mlxc.runtime.checkpoint import pixtral_preprocess as pp
from mlxc.runtime.model.vision import pixtral

ATOL = 1e-4
PATCH, MERGE = 4, 2


# --- helpers --------------------------------------------------------------------------------


def random_image(rng: np.random.Generator, h: int, w: int, mode: str = "RGB") -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, size=(h, w, channels), dtype=np.uint8)
    return Image.fromarray(data[..., 0] if channels == 1 else data, mode=mode)


def rerandomise(model: torch.nn.Module, seed: int) -> None:
    """transformers' init is near zero (hides bugs): give every parameter real variance."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm weights around 1, biases around 0
                base = 1.0 if name.endswith("norm.weight") else 0.0
                p.copy_(base + 0.3 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)


def build_hf(seed: int, *, hidden_act="gelu", bias=False, feature_layer=-1, layers=2):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "patch_size": PATCH,
            "image_size": 64,
            "hidden_act": hidden_act,
            "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
        },
        text_config={
            "model_type": "mistral",
            "hidden_size": 48,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 64,
            "rms_norm_eps": 1e-5,
        },
        spatial_merge_size=MERGE,
        multimodal_projector_bias=bias,
        vision_feature_layer=feature_layer,
        projector_hidden_act="gelu",
    )
    config._attn_implementation = "eager"  # the block-diagonal mask path
    model = Mistral3ForConditionalGeneration(config).eval()
    rerandomise(model, seed)
    return model, config.to_dict()


def build_mlx(hf_model, config: dict):
    """MLX tower + projector loaded strictly from the transformers-5 state dict."""
    tower = pixtral.PixtralVisionModel(
        pixtral.PixtralVisionArgs.from_config(config["vision_config"])
    )
    proj_args = pixtral.Mistral3ProjectorArgs.from_config(config)
    projector = pixtral.Mistral3MultiModalProjector(proj_args)
    weights = pixtral.sanitize({k: mx.array(v.numpy()) for k, v in hf_model.state_dict().items()})
    for prefix, module in (
        ("model.vision_tower.", tower),
        ("model.multi_modal_projector.", projector),
    ):
        part = [(k[len(prefix) :], v) for k, v in weights.items() if k.startswith(prefix)]
        module.load_weights(part, strict=True)
    return tower, projector, proj_args


def hf_features(model, pixel_values: np.ndarray, image_sizes: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model.get_image_features(
            pixel_values=torch.from_numpy(pixel_values), image_sizes=torch.from_numpy(image_sizes)
        )
    return torch.cat(out.pooler_output, dim=0).numpy()


def mlx_features(tower, projector, args, pixel_values, image_sizes) -> np.ndarray:
    out = pixtral.image_features(
        tower, projector, mx.array(pixel_values), image_sizes, args.vision_feature_layer
    )
    return np.array(out)


# --- tower + projector ----------------------------------------------------------------------


VARIANTS = {
    "gelu-last": {"hidden_act": "gelu", "bias": False, "feature_layer": -1},
    "silu-bias-earlier-layer": {
        "hidden_act": "silu",
        "bias": True,
        "feature_layer": -2,
        "layers": 3,
    },
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_image_features_match_transformers(variant, rng):
    hf, config = build_hf(seed=7, **VARIANTS[variant])
    tower, projector, args = build_mlx(hf, config)

    # One image; then two of different sizes padded into one batch (as the processor does);
    # the second has odd patch rows/cols so the merger's dropped edge is exercised too.
    one = rng.standard_normal((1, 3, 32, 48)).astype(np.float32)
    sizes_one = np.array([[32, 48]])
    two = rng.standard_normal((2, 3, 40, 48)).astype(np.float32)
    sizes_two = np.array([[24, 48], [40, 20]])
    two[0, :, 24:] = 0.0  # padding as the processor writes it
    two[1, :, :, 20:] = 0.0

    for pv, sizes in ((one, sizes_one), (two, sizes_two)):
        want = hf_features(hf, pv, sizes)
        got = mlx_features(tower, projector, args, pv, sizes)
        assert got.shape == want.shape
        assert sum(pixtral.tokens_per_image(sizes, PATCH, MERGE)) == want.shape[0]
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_processed_images_end_to_end(rng):
    """Preprocess real PIL images with our code, features equal transformers' on the same."""
    hf, config = build_hf(seed=11)
    tower, projector, args = build_mlx(hf, config)
    cfg = pp.PixtralProcessorConfig(patch_size=PATCH, spatial_merge_size=MERGE, longest_edge=48)
    images = [random_image(rng, 45, 30), random_image(rng, 17, 60)]
    pv, sizes = pp.preprocess_images(images, cfg)
    np.testing.assert_allclose(
        mlx_features(tower, projector, args, pv, sizes),
        hf_features(hf, pv, sizes),
        atol=ATOL,
        rtol=0,
    )


def test_sanitize_is_idempotent_and_leaves_others():
    w = {
        "vision_tower.patch_conv.weight": mx.arange(32 * 3 * 4 * 4).reshape(32, 3, 4, 4),
        "vision_tower.ln_pre.weight": mx.ones((32,)),
    }
    once = pixtral.sanitize(w)
    twice = pixtral.sanitize(once)
    assert once["vision_tower.patch_conv.weight"].shape == (32, 4, 4, 3)
    assert mx.array_equal(
        once["vision_tower.patch_conv.weight"], twice["vision_tower.patch_conv.weight"]
    )
    assert once["vision_tower.ln_pre.weight"] is w["vision_tower.ln_pre.weight"]
    with pytest.raises(ValueError, match="ambiguous"):
        pixtral.sanitize({"patch_conv.weight": mx.zeros((8, 3, 3, 3))})


def test_image_rows_match_masked_scatter_across_chunks(rng):
    """What the models use (ImageFeatures.take + replace), also split over two chunks."""
    from mlxc.runtime.model.multimodal import ImageFeatures

    img = 5
    ids = np.array([[1, img, img, 2, img], [img, 3, 4, img, img]])
    embeds = rng.standard_normal((2, 5, 6)).astype(np.float32)
    feats = rng.standard_normal((int((ids == img).sum()), 6)).astype(np.float32)
    mask = torch.from_numpy(ids == img)[..., None].expand(2, 5, 6)
    want = torch.from_numpy(embeds).masked_scatter(mask, torch.from_numpy(feats)).numpy()
    features = ImageFeatures(mx.array(feats))
    rows = features.take(mx.array(ids), img)
    got = rows.replace(mx.array(embeds), features.embeds)
    np.testing.assert_array_equal(np.array(got), want)
    # One sequence in two chunks takes the rows in order.
    seq = np.array([[img, 1, img, img, 2, img]])
    features = ImageFeatures(mx.array(feats[:4]))
    parts = [
        features.take(mx.array(seq[:, :3]), img).replace(mx.zeros((1, 3, 6)), features.embeds),
        features.take(mx.array(seq[:, 3:]), img).replace(mx.zeros((1, 3, 6)), features.embeds),
    ]
    got = np.concatenate([np.array(p) for p in parts], axis=1)[0]
    np.testing.assert_array_equal(got[[0, 2, 3, 5]], feats[:4])
    # Every row used: a later (e.g. generated) placeholder is plain text.
    assert features.take(mx.array([[img]]), img) is None
    # A chunk that asks for more rows than remain is an inconsistent prompt.
    features = ImageFeatures(mx.array(feats[:2]))
    with pytest.raises(ValueError, match="more image tokens"):
        features.take(mx.array([[img, img, img]]), img)


# --- preprocessing --------------------------------------------------------------------------


SIZES = [(45, 30, "RGB"), (17, 60, "RGBA"), (64, 64, "L"), (100, 70, "RGB")]


def test_preprocess_matches_pil_image_processor(rng):
    cfg = pp.PixtralProcessorConfig(patch_size=PATCH, spatial_merge_size=MERGE, longest_edge=48)
    hf = PixtralImageProcessorPil(
        patch_size={"height": PATCH * MERGE, "width": PATCH * MERGE}, size={"longest_edge": 48}
    )
    images = [random_image(rng, h, w, mode) for h, w, mode in SIZES]
    for batch in (images[:1], images[:2], images):
        want = hf(batch, return_tensors="np")
        pv, sizes = pp.preprocess_images(batch, cfg)
        np.testing.assert_array_equal(sizes, np.asarray(want["image_sizes"]))
        assert pv.dtype == np.float32 and pv.shape == want["pixel_values"].shape
        np.testing.assert_allclose(pv, want["pixel_values"], atol=1e-5, rtol=0)


def test_resized_size_matches_transformers():
    for h in range(1, 130, 7):
        for w in range(1, 130, 11):
            want = get_resize_output_image_size(
                np.zeros((3, h, w)),
                size=(48, 48),
                patch_size=(8, 8),
                input_data_format="channels_first",
            )
            assert pp.resized_size(h, w, 48, 8) == tuple(want)


@pytest.fixture
def pixtral_processor_cls(monkeypatch):
    """transformers' PixtralProcessor; its module imports a torchvision-only helper, which a
    shim replaces with the identical PIL one when torchvision is absent (as here)."""
    name = "transformers.models.pixtral.processing_pixtral"
    if importlib.util.find_spec("torchvision") is None:
        from transformers.models.pixtral import image_processing_pil_pixtral as pil

        shim = types.ModuleType("transformers.models.pixtral.image_processing_pixtral")
        shim.get_resize_output_image_size = pil.get_resize_output_image_size
        monkeypatch.setitem(sys.modules, shim.__name__, shim)
    monkeypatch.delitem(sys.modules, name, raising=False)
    yield importlib.import_module(name).PixtralProcessor
    sys.modules.pop(name, None)  # built against the shim: do not leave it for others


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "a", "b", "c", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["[IMG]", "[IMG_BREAK]", "[IMG_END]"],
    )


def test_token_expansion_matches_pixtral_processor(pixtral_processor_cls, rng):
    tok = tiny_tokenizer()
    hf = pixtral_processor_cls(
        image_processor=PixtralImageProcessorPil(),
        tokenizer=tok,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
    )
    cfg = pp.PixtralProcessorConfig(patch_size=PATCH, spatial_merge_size=MERGE, longest_edge=48)
    ids = pp.image_token_ids(tok, cfg, {"image_token_index": 6})
    assert ids == (6, 7, 8)
    images = [random_image(rng, h, w, mode) for h, w, mode in SIZES[:3]]
    prompt = "a [IMG] b [IMG] c [IMG]"
    for n in (1, 3):
        text = prompt if n == 3 else "a [IMG] b"
        want = hf(
            text=text,
            images=images[:n],
            images_kwargs={"size": {"longest_edge": 48}},
            return_tensors="np",
        )
        pv, sizes = pp.preprocess_images(images[:n], cfg)
        np.testing.assert_array_equal(sizes, want["image_sizes"])
        np.testing.assert_allclose(pv, want["pixel_values"], atol=1e-5, rtol=0)
        # ids path (tokenize the short prompt, then expand) and text path agree with transformers
        by_ids = pp.expand_image_tokens(tok(text).input_ids, sizes, PATCH, MERGE, *ids)
        by_text = pp.expand_image_tokens(
            text, sizes, PATCH, MERGE, "[IMG]", "[IMG_BREAK]", "[IMG_END]"
        )
        assert by_ids == want["input_ids"][0].tolist()
        assert tok(by_text).input_ids == by_ids
        # each image: [IMG] count equals its feature rows
        assert by_ids.count(6) == sum(pixtral.tokens_per_image(sizes, PATCH, MERGE))
    with pytest.raises(ValueError, match="placeholders"):
        pp.expand_image_tokens([1, 6, 2], np.zeros((2, 2)) + 8, PATCH, MERGE, *ids)


def test_processor_config_from_files(tmp_path):
    """Hub layout: preprocessor_config.json (image processor) + processor_config.json."""
    (tmp_path / "preprocessor_config.json").write_text(
        '{"image_processor_type": "PixtralImageProcessorFast", "patch_size": {"height": 14, '
        '"width": 14}, "size": {"longest_edge": 1540}, "resample": 3, '
        '"rescale_factor": 0.00392156862745098, "image_mean": [0.5, 0.5, 0.5], '
        '"image_std": [0.25, 0.25, 0.25]}'
    )
    (tmp_path / "processor_config.json").write_text(
        '{"image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]", '
        '"image_token": "[IMG]", "patch_size": 14, "processor_class": "PixtralProcessor", '
        '"spatial_merge_size": 2}'
    )
    cfg = pp.PixtralProcessorConfig.from_pretrained(tmp_path)
    assert (cfg.patch_size, cfg.spatial_merge_size, cfg.longest_edge) == (14, 2, 1540)
    assert cfg.resize_multiple == 28 and cfg.image_mean == (0.5, 0.5, 0.5)
