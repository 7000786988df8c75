"""Gemma 3's vision side against transformers (CPU, float32): the SigLIP tower + Gemma-3
projector (``Gemma3Model.get_image_features``), the image preprocessing and prompt expansion
(``Gemma3ImageProcessorPil`` + ``Gemma3Processor``), and the bidirectional image-attention
overlay (transformers' ``create_masks_for_vision_model``)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from PIL import Image

from mlxc.runtime.model.vision import siglip

ATOL = 1e-4
IMAGE, PATCH, MM_TOKENS = 16, 4, 4  # a 4x4 patch grid pooled 2x2 to 4 tokens


def rerandomise(model: torch.nn.Module, seed: int) -> None:
    """transformers' init is near zero (hides bugs): give every parameter real variance."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # LayerNorm weights around 1, Gemma's offset weights and biases ~0
                base = 1.0 if "layer_norm" in name or "layernorm" in name else 0.0
                p.copy_(base + 0.3 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)


# Key for key the hub google/gemma-3-4b-it config.json (sizes shrunk); text_config trimmed to
# what the vision side reads plus the layout keys.
def gemma3_config(**vision):
    from transformers import Gemma3Config

    config = Gemma3Config(
        vision_config={
            "hidden_size": 32,
            "image_size": IMAGE,
            "intermediate_size": 48,
            "model_type": "siglip_vision_model",
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "patch_size": PATCH,
            "vision_use_head": False,
            **vision,
        },
        text_config={
            "hidden_size": 24,
            "intermediate_size": 32,
            "model_type": "gemma3_text",
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "num_key_value_heads": 1,
            "head_dim": 12,
            "vocab_size": 300,
            "sliding_window": 8,
        },
        boi_token_index=255,
        eoi_token_index=256,
        image_token_index=262,
        mm_tokens_per_image=MM_TOKENS,
        eos_token_id=[1, 106],
        initializer_range=0.02,
    )
    config._attn_implementation = "eager"
    return config


def build_hf(seed: int, **vision):
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration(gemma3_config(**vision)).eval()
    rerandomise(model, seed)
    return model


def hub_names(state: dict) -> dict:
    """transformers-5 module names -> the hub (transformers-4) checkpoint names."""
    out = {}
    for k, v in state.items():
        k = k.replace("model.vision_tower.", "vision_tower.vision_model.")
        out[k.replace("model.multi_modal_projector.", "multi_modal_projector.")] = v
    return out


def build_mlx(config: dict, weights: dict, prefix: str):
    args = siglip.Gemma3ProjectorArgs.from_config(config)
    tower = siglip.SiglipVisionModel(args.vision)
    projector = siglip.Gemma3MultiModalProjector(args)
    weights = siglip.sanitize({k: mx.array(v.numpy()) for k, v in weights.items()})
    for name, module in (("vision_tower.", tower), ("multi_modal_projector.", projector)):
        part = [
            (k[len(prefix + name) :], v) for k, v in weights.items() if k.startswith(prefix + name)
        ]
        module.load_weights(part, strict=True)
    return tower, projector


def saved_names(model, tmp_path) -> dict:
    from safetensors.torch import load_file

    model.save_pretrained(tmp_path)
    return load_file(str(tmp_path / "model.safetensors"))


@pytest.mark.parametrize("variant", ["t5-modules", "t5-saved", "hub"])
def test_image_features_match_transformers(variant, tmp_path, rng):
    # vision_use_head on in the saved-file variant: its head tensors must be dropped.
    hf = build_hf(seed=3, vision_use_head=variant == "t5-saved", hidden_act="gelu_pytorch_tanh")
    config = hf.config.to_dict()
    state = hf.state_dict()
    if variant == "t5-modules":
        tower, projector = build_mlx(config, state, "model.")
    elif variant == "t5-saved":
        saved = saved_names(hf, tmp_path)
        assert any(k.startswith("vision_tower.embeddings.") for k in saved)
        assert any(k.startswith("vision_tower.head.") for k in saved)
        tower, projector = build_mlx(config, saved, "")
    else:
        tower, projector = build_mlx(config, hub_names(state), "")

    pixel_values = rng.standard_normal((3, 3, IMAGE, IMAGE)).astype(np.float32)
    with torch.no_grad():
        want = hf.model.get_image_features(torch.from_numpy(pixel_values)).pooler_output
    want = want.reshape(-1, want.shape[-1]).numpy()
    got = np.array(siglip.image_features(tower, projector, mx.array(pixel_values)))
    assert got.shape == (3 * MM_TOKENS, 24) == want.shape
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_pool_of_one_and_exact_gelu(rng):
    """mm_tokens_per_image == the patch count (no pooling) and another activation."""
    from transformers import Gemma3ForConditionalGeneration

    config = gemma3_config(hidden_act="gelu")
    config.mm_tokens_per_image = (IMAGE // PATCH) ** 2
    hf = Gemma3ForConditionalGeneration(config).eval()
    rerandomise(hf, seed=5)
    tower, projector = build_mlx(config.to_dict(), hf.state_dict(), "model.")
    pixel_values = rng.standard_normal((1, 3, IMAGE, IMAGE)).astype(np.float32)
    with torch.no_grad():
        want = hf.model.get_image_features(torch.from_numpy(pixel_values)).pooler_output[0]
    got = np.array(siglip.image_features(tower, projector, pixel_values))
    np.testing.assert_allclose(got, want.numpy(), atol=ATOL, rtol=0)


def test_config_errors():
    config = gemma3_config().to_dict()
    with pytest.raises(siglip.ConfigError, match="mm_tokens_per_image"):
        siglip.Gemma3ProjectorArgs.from_config({**config, "mm_tokens_per_image": 3})
    with pytest.raises(siglip.ConfigError, match="mm_tokens_per_image"):
        siglip.Gemma3ProjectorArgs.from_config({**config, "mm_tokens_per_image": 9})  # 3 ∤ 4
    args = siglip.Gemma3ProjectorArgs.from_config(config)
    tower = siglip.SiglipVisionModel(args.vision)
    with pytest.raises(ValueError, match="image_size"):
        tower(mx.zeros((1, 3, IMAGE + PATCH, IMAGE)))


# --- image attention ------------------------------------------------------------------------

IMG_ID = 9
# text, image of 4, text, image of 3 (Gemma 3 always wraps an image in boi/eoi text tokens)
LAYOUT = [2, 5, IMG_ID, IMG_ID, IMG_ID, IMG_ID, 6, 7, 5, IMG_ID, IMG_ID, IMG_ID, 6, 8]


def hf_masks(ids: list[int], window: int) -> dict[str, np.ndarray]:
    """transformers' Gemma 3 prefill masks for the whole prompt, ``[T, T]`` bool."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    config = Gemma3TextConfig(
        hidden_size=8,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        num_hidden_layers=2,
        sliding_window=window,
        vocab_size=16,
    )
    config._attn_implementation = "sdpa"
    token_type_ids = torch.tensor([[int(t == IMG_ID) for t in ids]])
    T = len(ids)
    out = create_masks_for_vision_model(
        config=config,
        inputs_embeds=torch.zeros(1, T, 8),
        attention_mask=None,
        cache=None,
        position_ids=torch.arange(T)[None],
        block_sequence_ids=get_block_sequence_ids_for_mask(token_type_ids),
    )
    return {k: v[0, 0].numpy() for k, v in out.items()}


def chunk_mask(ids, start, end, window):
    """What a TextModel builds for chunk [start, end) with every earlier key live."""
    from mlxc.runtime.model import image_attention, masks

    is_image = mx.array([[t == IMG_ID for t in ids[start:end]]])
    L = end - start
    mask = image_attention.with_images(masks.causal(L, end, window=window), is_image, end, window)
    if isinstance(mask, str) or mask is None:
        mask = mx.arange(end)[None, :] <= mx.arange(end - L, end)[:, None]
    return np.broadcast_to(np.array(mask), (1, 1, L, end))[0, 0]


@pytest.mark.parametrize("window", [3, 5, 100])
@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 14])
def test_image_overlay_matches_transformers(window, chunk):
    from mlxc.runtime.model import image_attention
    from mlxc.runtime.serving.generate import prefill_chunks

    want = hf_masks(LAYOUT, window)
    spans = image_attention.image_spans(LAYOUT, IMG_ID)
    assert spans == [(2, 6), (9, 12)]
    bounds = prefill_chunks(len(LAYOUT), chunk, spans)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(LAYOUT)
    assert all(a == b for (_, a), (b, _) in itertools.pairwise(bounds))
    for start, end in bounds:
        assert not any(s < start < e for s, e in spans), "a chunk boundary cut an image"
        for name, w in (("full_attention", None), ("sliding_attention", window)):
            got = chunk_mask(LAYOUT, start, end, w)
            np.testing.assert_array_equal(got, want[name][start:end, :end], err_msg=name)


def test_a_cut_image_loses_exactly_its_cross_chunk_pairs():
    """Why prefills keep images whole: chunk [0, 4) ends inside the first image, whose
    positions 2, 3 then cannot see 4, 5 (they lie in the next forward)."""
    want = hf_masks(LAYOUT, 100)["full_attention"]
    got = chunk_mask(LAYOUT, 0, 4, None)
    assert want[2:4, 4:6].all()
    np.testing.assert_array_equal(got, want[:4, :4])


def test_overlay_shapes_and_groups():
    from mlxc.runtime.model import image_attention

    is_image = mx.array([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]]).astype(mx.bool_)
    groups = np.array(image_attention.image_groups(is_image))
    np.testing.assert_array_equal(groups, [[-1, 0, 0, -1, 1], [0, 0, -1, -1, -1]])
    extra = np.array(image_attention.overlay(is_image, n_keys=7))
    assert extra.shape == (2, 1, 5, 7)
    assert not extra[..., :2].any()  # earlier keys: causality already covers them
    assert extra[0, 0, 1, 4] and extra[0, 0, 2, 3] and not extra[0, 0, 1, 6]  # keys: 2 + pos
    # One query (decode) or no image token: the mask is unchanged.
    assert image_attention.with_images(None, mx.array([[True]]), 5) is None
    no_images = mx.zeros((1, 3), dtype=mx.bool_)
    mask = image_attention.with_images("causal", no_images, 3)
    np.testing.assert_array_equal(np.array(mask)[0, 0], np.tril(np.ones((3, 3), bool)))
    with pytest.raises(ValueError, match="live keys"):
        image_attention.overlay(is_image, n_keys=4)


@pytest.mark.parametrize(
    "n, chunk, spans, want",
    [
        (10, 4, [(2, 6)], [(0, 6), (6, 9), (9, 10)]),  # 4 is inside (2, 6): that chunk grows
        (10, 4, [(4, 8)], [(0, 4), (4, 8), (8, 9), (9, 10)]),  # boundaries on the edges stay
        (10, 4, [(7, 10)], [(0, 4), (4, 10)]),  # an image at the end: no lone last token
        (10, 20, [(1, 9)], [(0, 9), (9, 10)]),
    ],
)
def test_prefill_chunks_keep_spans_whole(n, chunk, spans, want):
    from mlxc.runtime.serving.generate import prefill_chunks

    with mx.stream(mx.cpu):  # the CPU rule: the last token alone
        assert prefill_chunks(n, chunk, spans) == want


# --- the tower in a generated model ---------------------------------------------------------


def test_a_spec_with_the_gemma3_tower_builds_and_loads_hub_names(tmp_path, rng):
    """The tower's template in a generated VisionLanguageModel (a mistral text decoder stands in
    until the gemma3 text spec exists): hub names load through the spec's renames and
    sanitize_vision, the features match transformers, and a prompt with images runs."""
    from mlxc.compiler import build
    from mlxc.verify import load_source

    text = (Path(__file__).parents[1] / "specs" / "mistral3.yaml").read_text()
    text = text.replace("name: mistral3", "name: probe").replace(
        "tower: pixtral", "tower: gemma3_siglip"
    )
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "probe.yaml").write_text(text)
    result = build.render([str(specs)])
    assert result.findings == []
    module = load_source("probe_gemma3", result.files["probe.py"])
    assert module.VISION_TOWER == "gemma3_siglip"

    hf = build_hf(seed=11)
    config = hf.config.to_dict()
    config["text_config"] = {
        "model_type": "mistral",
        "hidden_size": 24,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 12,
        "intermediate_size": 32,
        "vocab_size": 300,
    }
    model = module.Model(module.ModelArgs.from_config(config))
    state = {k: mx.array(v.numpy()) for k, v in hub_names(hf.state_dict()).items()}
    vision = {k: v for k, v in state.items() if not k.startswith(("model.language", "lm_head"))}
    assert any(k.startswith("vision_tower.vision_model.") for k in vision)
    weights = model.sanitize(vision)
    want_names = {k for k, _ in nn_leaves(model) if "language_model" not in k}
    assert set(weights) == want_names
    model.load_weights(list(weights.items()), strict=False)

    pixel_values = rng.standard_normal((2, 3, IMAGE, IMAGE)).astype(np.float32)
    with torch.no_grad():
        want = hf.model.get_image_features(torch.from_numpy(pixel_values)).pooler_output
    got = model.model.image_features(mx.array(pixel_values)).embeds
    np.testing.assert_allclose(np.array(got), want.reshape(-1, 24).numpy(), atol=ATOL, rtol=0)

    image = [255] + [262] * MM_TOKENS + [256]
    ids = [2, 5] + image + [7] + image + [8]
    assert model.model.prefill_spans(ids) == [(3, 3 + MM_TOKENS), (10, 10 + MM_TOKENS)]
    logits = model(mx.array([ids]), pixel_values=mx.array(pixel_values))
    assert logits.shape == (1, len(ids), 300) and bool(mx.isfinite(logits).all())


def nn_leaves(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


# --- preprocessing and prompt expansion -----------------------------------------------------

# google/gemma-3-4b-it's processor files: preprocessor_config.json, processor_config.json and
# chat_template.json as the hub has them; tokenizer_config.json with every key, its
# added_tokens_decoder shrunk to the specials of the tiny vocabulary below (ids 0-9 for the
# hub's 0-4, 105, 106, 255999, 256000, 262144).
GEMMA3_FILES = Path(__file__).parent / "fixtures" / "gemma_3_4b_it"
SPECIALS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
BOI, EOI, SOFT = 7, 8, 9


def write_gemma_tokenizer(path):
    """A GemmaTokenizer (BPE, byte fallback) over a tiny vocabulary whose newline runs are
    single tokens, as in Gemma's: expanding ids instead of text would tokenize differently."""
    from tokenizers import processors
    from transformers import GemmaTokenizer

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab |= {f"<0x{b:02X}>": len(vocab) + b for b in range(256)}
    merges = [("\n", "\n"), ("\n\n", "\n"), ("\n\n", "\n\n"), ("d", "e"), ("de", "s")]
    for piece in ["\n", "\n\n", "\n\n\n", "\n\n\n\n", "▁", *"abcdefghijklmnopqrstuvwxyz"]:
        vocab.setdefault(piece, len(vocab))
    vocab |= {"de": len(vocab), "des": len(vocab) + 1}
    tok = GemmaTokenizer(vocab=vocab, merges=merges)
    # The hub tokenizer.json's post-processor: BOS first (the chat template writes its own).
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 2)]
    )
    tok.save_pretrained(str(path))
    for name in ("tokenizer_config.json", "chat_template.json"):
        shutil.copyfile(GEMMA3_FILES / name, path / name)
    (path / "chat_template.jinja").unlink(missing_ok=True)  # the hub repo has none


def write_gemma3_dir(path, **preprocessor):
    from transformers import Gemma3Config

    write_gemma_tokenizer(path)
    for name in ("preprocessor_config.json", "processor_config.json"):
        shutil.copyfile(GEMMA3_FILES / name, path / name)
    if preprocessor:
        pre = json.loads((path / "preprocessor_config.json").read_text()) | preprocessor
        (path / "preprocessor_config.json").write_text(json.dumps(pre))
    Gemma3Config(
        image_token_index=SOFT,
        boi_token_index=BOI,
        eoi_token_index=EOI,
        text_config={"vocab_size": 320},
    ).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return write_gemma3_dir(tmp_path_factory.mktemp("gemma3"))


def images(*sizes, seed=0, mode="RGB"):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    out = []
    for h, w in sizes:
        data = rng.integers(0, 256, size=(h, w, channels), dtype=np.uint8)
        out.append(Image.fromarray(data[..., 0] if channels == 1 else data, mode=mode))
    return out


def hf_processor(path):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(path))
    assert type(processor.image_processor).__name__ == "Gemma3ImageProcessorPil"  # no torchvision
    return processor


def test_preprocessing_matches_transformers(gemma3_dir):
    from mlxc.runtime.checkpoint import gemma3_preprocess as gp

    cfg = gp.Gemma3ProcessorConfig.from_pretrained(gemma3_dir)
    assert (cfg.height, cfg.width, cfg.resample, cfg.image_seq_length) == (896, 896, 2, 256)
    assert not cfg.do_pan_and_scan  # null in the hub file
    imgs = images((30, 50), (97, 20)) + images((12, 9), mode="RGBA", seed=1)
    imgs += images((900, 1000), mode="L", seed=2)  # shrunk, grey
    # do_convert_rgb is null in the file; Gemma3Processor passes its default, True.
    image_processor = hf_processor(gemma3_dir).image_processor
    want = image_processor(imgs, return_tensors="np", do_convert_rgb=True)["pixel_values"]
    got, crops = gp.preprocess_images(imgs, cfg)
    assert got.dtype == np.float32 and crops == [0, 0, 0, 0]
    # Both resize the same uint8 image through PIL and normalise in the same dtypes: exact.
    np.testing.assert_array_equal(got, want)


def test_pan_and_scan_matches_transformers(tmp_path):
    """Off whatever the file says, as Gemma3Processor passes its own defaults; asked for, the
    crops and their prompt text match ``processor(..., do_pan_and_scan=True)``."""
    from mlxc.runtime.checkpoint import gemma3_preprocess as gp
    from mlxc.runtime.checkpoint import processor as proc
    from mlxc.runtime.checkpoint.tokenizer import load_tokenizer

    path = write_gemma3_dir(
        tmp_path,
        do_pan_and_scan=True,
        size={"height": 32, "width": 32},
        pan_and_scan_max_num_crops=2,
    )
    tokenizer = load_tokenizer(path)
    processor = proc.load_processor(path, tokenizer, "gemma3_siglip")
    hf = hf_processor(path)
    # wide: 3 crops; tall: 3; ratio 1.33 but crops under 256: none; square: none
    imgs = images((300, 900), (800, 300), (400, 300), (300, 300), seed=4)
    text = "<start_of_image>" * 4 + "des"  # encode_text_and_images: the images, then the text
    for on in (False, True):
        processor.cfg = dataclasses.replace(processor.cfg, do_pan_and_scan=on)
        want = hf(text=text, images=imgs, return_tensors="np", do_pan_and_scan=on)
        got = processor.encode_text_and_images("des", imgs, chat_template=False)
        assert got.ids == want["input_ids"][0].tolist()
        np.testing.assert_array_equal(got.vision["pixel_values"], want["pixel_values"])
        crops = gp.preprocess_images(imgs, processor.cfg)[1]
        assert crops == ([3, 3, 0, 0] if on else [0, 0, 0, 0])


def gemma3_messages(part="image"):
    return [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": part}, {"type": "text", "text": "describe"}, {"type": part}],
        },
        {"role": "assistant", "content": "des"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
    ]


def test_prompt_matches_gemma3_processor(gemma3_dir):
    from mlxc.runtime.checkpoint import processor as proc
    from mlxc.runtime.checkpoint.tokenizer import load_tokenizer
    from mlxc.runtime.model import image_attention

    tokenizer = load_tokenizer(gemma3_dir)
    processor = proc.load_processor(gemma3_dir, tokenizer, "gemma3_siglip")
    imgs = images((30, 50), (97, 20), (12, 9), seed=3)
    prompt = processor.encode(gemma3_messages(), imgs)

    hf = hf_processor(gemma3_dir)
    messages = gemma3_messages()
    it = iter(imgs)
    for m in messages:
        if isinstance(m["content"], list):
            m["content"] = [
                {"type": "image", "image": next(it)} if p["type"] != "text" else p
                for p in m["content"]
            ]
    want = hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="np"
    )
    assert prompt.ids == want["input_ids"][0].tolist()
    assert prompt.ids.count(2) == 1  # one BOS: the template's
    assert prompt.ids.count(SOFT) == 3 * 256 and prompt.ids.count(BOI) == 3
    np.testing.assert_array_equal(prompt.vision["pixel_values"], want["pixel_values"])
    assert set(prompt.vision) == {"pixel_values"}
    # The image runs are transformers' token_type_ids == 1 runs.
    spans = image_attention.image_spans(prompt.ids, SOFT)
    types = np.zeros(len(prompt.ids), int)
    for s, e in spans:
        types[s:e] = 1
    np.testing.assert_array_equal(types, want["token_type_ids"][0])
    assert [e - s for s, e in spans] == [256] * 3


def test_prompt_without_chat_template_and_errors(gemma3_dir, tmp_path):
    from mlxc.runtime.checkpoint import processor as proc
    from mlxc.runtime.checkpoint.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(gemma3_dir)
    processor = proc.load_processor(gemma3_dir, tokenizer, "gemma3_siglip")
    imgs = images((30, 50), seed=5)
    prompt = processor.encode_text_and_images("describe", imgs, chat_template=False)
    # Gemma3Processor on "<start_of_image>describe": expanded text, tokenized with BOS.
    want = hf_processor(gemma3_dir)(text="<start_of_image>describe", images=imgs)
    assert prompt.ids == list(want["input_ids"][0])
    assert prompt.ids[0] == 2
    with pytest.raises(proc.ImageInputError, match="3 image part"):
        processor.encode(gemma3_messages(), imgs)
    # A text-only prompt keeps a typed <start_of_image> as it is (no image, no expansion).
    assert processor.encode([{"role": "user", "content": "a"}]).ids.count(SOFT) == 0

    bad = write_gemma3_dir(tmp_path)
    config = json.loads((bad / "config.json").read_text()) | {"mm_tokens_per_image": 64}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="image_seq_length 256 != config.json"):
        proc.load_processor(bad, tokenizer, "gemma3_siglip")
    config |= {"mm_tokens_per_image": 256, "image_token_index": 5}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="image_token_index 5"):
        proc.load_processor(bad, tokenizer, "gemma3_siglip")
